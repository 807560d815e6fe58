"""Attention masks for a batch of rows, each with its own committed length and window.

WeDLM feeds filled window slots before mask slots (topological reordering) and runs plain
causal attention over that physical order. We keep the rows in their natural slot order
instead (so RoPE positions stay contiguous, C..C+T-1) and express the same visibility with
an explicit mask: slot i sees slot j when j comes no later than i in the physical order.
With every slot filled that is exactly the causal mask, so prefill and autoregressive
steps use the same rule.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def window_visibility(filled: np.ndarray) -> np.ndarray:
    """[T, T] bool for one row: may slot i (query) see slot j (key)?

    Physical order = filled slots ascending, then mask slots ascending. Filled slot i
    sees filled j <= i; mask slot i sees every filled slot and mask slots j <= i.
    """
    filled = np.asarray(filled, dtype=bool)
    j_le_i = np.tri(filled.shape[0], dtype=bool)  # [i, j] = j <= i
    return _visible(filled[None, :], ~filled[:, None], j_le_i)


def device_visibility(filled: mx.array) -> mx.array:
    """[B, T, T]: window_visibility of every row of `filled` [B, T], on the device (a
    look-ahead WeDLM window, whose filled slots the host does not know yet)."""
    j_le_i = mx.tril(mx.ones((filled.shape[-1],) * 2, dtype=mx.bool_))[None]
    return _visible(filled[:, None, :], ~filled[:, :, None], j_le_i)


def _visible(filled_j, is_mask_i, j_le_i):
    """The rule, for numpy or MLX arrays alike."""
    return (filled_j & (is_mask_i | j_le_i)) | (~filled_j & is_mask_i & j_le_i)


def batch_window_masks(filled_rows: list[np.ndarray], width: int) -> np.ndarray:
    """[B, width, width] visibilities, padded: padding slots see only themselves."""
    out = np.zeros((len(filled_rows), width, width), dtype=bool)
    out[:, np.arange(width), np.arange(width)] = True
    for b, filled in enumerate(filled_rows):
        t = len(filled)
        if t:
            out[b, :t, :t] = window_visibility(filled)
    return out


def attention_mask(starts: mx.array, windows: mx.array, span: int) -> mx.array:
    """[B, 1, T, span] bool over cache positions for rows whose window starts at `starts`.

    Key k is visible when it is committed (k < start) or is window slot k - start and the
    window visibility allows it. Keys past the window are stale rows of other steps.
    """
    t = windows.shape[-1]
    rel = mx.arange(span)[None, :] - starts[:, None]  # [B, span]
    in_window = (rel >= 0) & (rel < t)
    idx = mx.broadcast_to(mx.clip(rel, 0, t - 1)[:, None, :], (rel.shape[0], t, span))
    seen = mx.take_along_axis(windows, idx, axis=2) & in_window[:, None, :]
    return ((rel < 0)[:, None, :] | seen)[:, None, :, :]


# Traced once per shape and span (spans are rounded up to kv_rows.SPAN_STEP).
compiled_device_visibility = mx.compile(device_visibility)
compiled_attention_mask = mx.compile(attention_mask)
