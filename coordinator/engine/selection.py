"""WeDLM slot selection on the device: entropy of the raw logits plus a position penalty,
a strict threshold, and the argmin fallback. Autoregressive rows pass as a one-slot window
with an infinite threshold, so both modes share one vectorized graph.

For WeDLM batches the engine runs the two as one compiled function (`window_fills`): about
35 small ops become a few fused kernels, and on MLX-CUDA each op costs the host its
recording and launch (RESULTS SC13: 0.27-0.51 ms of a WeDLM step eagerly, 0.17-0.28
compiled, same outputs). Speculative batches run them eagerly: their head slots change with
their drafts, and MLX traces a compiled function again for every new shape."""

from __future__ import annotations

import mlx.core as mx


def entropy(logits: mx.array) -> mx.array:
    """Entropy in nats of softmax(logits) over the last axis, computed in float32."""
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = mx.exp(logits - lse)
    return lse[..., 0] - mx.sum(probs * logits, axis=-1)


def select_fills(
    entropies: mx.array,
    is_mask: mx.array,
    threshold: mx.array,
    penalty: mx.array,
    offset: mx.array | None = None,
) -> mx.array:
    """[N, S] bool: which mask slots to fill this step.

    `adj = H + penalty * d` with d the slot's index after the commit (the window then starts
    with a mask, so d = 0 is the first remaining mask), less the row's `offset` (slots
    before it are not window slots: a speculative row's choices and first mask). Every slot
    with adj < threshold is filled; if none is, only the argmin. threshold = -inf is
    one-by-one mode.
    """
    s = entropies.shape[-1]
    distance = mx.arange(s, dtype=mx.float32)[None, :]
    if offset is not None:
        distance = distance - offset[:, None]
    adj = mx.where(is_mask, entropies + penalty[:, None] * distance, float("inf"))
    parallel = adj < threshold[:, None]
    best = mx.argmin(adj, axis=-1)
    fallback = (mx.arange(s)[None, :] == best[:, None]) & is_mask
    return mx.where(mx.any(parallel, axis=-1, keepdims=True), parallel, fallback)


def eager_window_fills(
    logits: mx.array,
    is_mask: mx.array,
    threshold: mx.array,
    penalty: mx.array,
    offset: mx.array | None = None,
) -> mx.array:
    """select_fills on the entropies of `logits` [N, S, V]."""
    return select_fills(entropy(logits), is_mask, threshold, penalty, offset)


# Traced once per shape (window widths and batch sizes are bucketed: forward_shapes.py).
window_fills = mx.compile(eager_window_fills)
