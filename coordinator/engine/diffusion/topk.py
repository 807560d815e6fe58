"""Exact top-K over a large vocabulary in two stages (the seed's hierarchical top-K): the
maximum of each chunk of the vocabulary, the K chunks with the largest maxima, then the
top K among those chunks' entries. Exact: a value in the global top K has fewer than K
values above it, hence fewer than K chunk maxima above its own chunk's maximum, so its
chunk is among the K chosen. Sorting 262,144 logits per position becomes a max pass and
two small partitions."""

from __future__ import annotations

import mlx.core as mx

DEFAULT_CHUNK = 256


def _top(values: mx.array, k: int) -> mx.array:
    """Indices of the k largest entries along the last axis (unordered)."""
    return mx.argpartition(-values, kth=k - 1, axis=-1)[..., :k]


def hierarchical_topk(
    logits: mx.array, k: int, chunk: int = DEFAULT_CHUNK
) -> tuple[mx.array, mx.array]:
    """([..., k] values in descending order, [..., k] their vocabulary indices)."""
    vocab = logits.shape[-1]
    k = min(k, vocab)
    lead = logits.shape[:-1]
    if vocab <= 2 * chunk:  # too small to gain: one partition
        idx = _top(logits, k)
        vals = mx.take_along_axis(logits, idx, axis=-1)
    else:
        pad = -vocab % chunk
        if pad:
            fill = mx.full((*lead, pad), -mx.inf, dtype=logits.dtype)
            logits = mx.concatenate([logits, fill], axis=-1)
        chunks = logits.reshape(*lead, -1, chunk)
        picked = _top(chunks.max(axis=-1), min(k, chunks.shape[-2]))  # [..., kc]
        cand = mx.take_along_axis(chunks, picked[..., None], axis=-2)  # [..., kc, chunk]
        cand = cand.reshape(*lead, -1)
        at = _top(cand, k)
        vals = mx.take_along_axis(cand, at, axis=-1)
        idx = mx.take_along_axis(picked, at // chunk, axis=-1) * chunk + at % chunk
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(idx, order, axis=-1)
