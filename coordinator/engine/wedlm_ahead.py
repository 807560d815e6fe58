"""WeDLM's look-ahead: the next window built on the device from this step's selection, so the
next forward is launched before the host reads this one back (as autoregressive decoding
launches step t+1 from its sampled token, engine._launch_ahead).

The next window's shape may not depend on what was selected: the host does not know it yet.
Its width is fixed at 2W (W window slots after this step's commit, then W mask slots) instead
of W + p. The p leading filled slots are committed by that forward exactly as in
wedlm-decoding.md step 1; the W - p extra trailing mask slots are seen by no other slot (a
mask slot sees the filled slots and the masks before it), so the slots that matter compute
what the W + p window computes. Which of its rows become permanent KV (p) and which rows'
logits selection needs (p .. p + W - 1) are known once the host has read this step back,
which happens while that forward runs: the host names them then (`resolve`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from coordinator.engine.row_plan import RowPlan


def next_inputs(
    plans: list[RowPlan],
    fills: mx.array,
    tokens: mx.array,
    mask_token_id: int,
    width: int,
    pad_rows: int,
) -> tuple[mx.array, mx.array]:
    """[rows + pad_rows, width] input ids and filled flags of the next forward, on the device.

    Row b's window after this step's commit is its plan's slots p.. (W of them) with the
    selected slots filled by the sampled tokens; mask slots follow up to `width`. Padding
    rows get one filled slot (they see themselves only, as in tick_batch.build_batch)."""
    rows = len(plans)
    k = fills.shape[1]
    old_tokens = np.full((rows, k), mask_token_id, np.int32)
    old_filled = np.zeros((rows, k), bool)
    for i, p in enumerate(plans):
        w = p.head_slots.size  # the window's W slots after the commit
        old_tokens[i, :w] = p.tokens[p.keep : p.keep + w]
        old_filled[i, :w] = p.filled[p.keep : p.keep + w]
    fills = fills[:rows]
    filled = mx.array(old_filled) | fills
    ids = mx.where(fills, tokens[:rows].astype(mx.int32), mx.array(old_tokens))
    if width > k:
        ids = mx.concatenate([ids, mx.full((rows, width - k), mask_token_id, mx.int32)], axis=1)
        filled = mx.concatenate([filled, mx.zeros((rows, width - k), mx.bool_)], axis=1)
    if pad_rows:
        pad_filled = mx.zeros((pad_rows, width), mx.bool_)
        pad_filled[:, 0] = True
        ids = mx.concatenate([ids, mx.zeros((pad_rows, width), mx.int32)])
        filled = mx.concatenate([filled, pad_filled])
    return ids, filled
