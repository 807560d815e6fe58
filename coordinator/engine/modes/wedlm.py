"""WeDLM streaming parallel decoding (../shared/docs/wedlm-decoding.md): a window of W slots,
mask slots filled by selection each forward, the leading filled run committed.

Its look-ahead: the next window built on the device from this step's selection, so the
next forward is launched before the host reads this one back (as autoregressive decoding
launches step t+1 from its sampled token, ar.py).

The next window's shape may not depend on what was selected: the host does not know it yet.
Its width is fixed at 2W (W window slots after this step's commit, then W mask slots) instead
of W + p. The p leading filled slots are committed by that forward exactly as in
wedlm-decoding.md step 1; the W - p extra trailing mask slots are seen by no other slot (a
mask slot sees the filled slots and the masks before it), so the slots that matter compute
what the W + p window computes. Which of its rows become permanent KV (p) and which rows'
logits selection needs (p .. p + W - 1) are known once the host has read this step back,
which happens while that forward runs: the host names them then (look_ahead.resolve)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.generation_params import GenerationParams
from common.modes import Mode
from common.window_mask import compiled_device_visibility
from coordinator.engine.forward_shapes import padded_width
from coordinator.engine.modes.base import (
    AheadForward,
    AheadRoom,
    DecodingMode,
    Flight,
    PlanContext,
    ahead_spec,
)
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Phase, Sequence


class WedlmMode(DecodingMode):
    name = Mode.WEDLM
    times_steps = False  # a window's forward is neither AR's nor a drafting one

    def uses_masks(self, params: GenerationParams) -> bool:
        return True

    def plan(self, seq: Sequence, ctx: PlanContext, room: int | None) -> RowPlan:
        return plan_wedlm(seq, ctx.mask_token_id)

    def first_token_from_prompt(self) -> bool:
        return False  # the prompt's logits are discarded (the decoding spec's step 1)

    def opening(
        self, seq: Sequence, chunk_tokens: np.ndarray, ctx: PlanContext
    ) -> RowPlan | None:
        """The first window, W masks after the prompt's last chunk (only the masks'
        logits are read)."""
        c, w = chunk_tokens.size, seq.params.window
        if c + w > ctx.prefill_chunk or seq.kv_length + c + w > ctx.max_positions:
            return None
        return RowPlan(
            seq=seq,
            tokens=np.concatenate([chunk_tokens, np.full(w, ctx.mask_token_id, np.int32)]),
            filled=np.arange(c + w) < c,
            keep=c,
            head_slots=np.arange(c, c + w),
            head_is_mask=np.ones(w, dtype=bool),
            opens=True,
        )

    def prefilled(self, seq: Sequence, plan: RowPlan) -> bool:
        w = seq.params.window
        seq.window_tokens = np.zeros(w, dtype=np.int32)
        seq.window_filled = np.zeros(w, dtype=bool)
        return plan.opens

    def commit(
        self, plan: RowPlan, fills: np.ndarray, tokens: np.ndarray, break_even: float
    ) -> list[int]:
        seq = plan.seq
        window = plan.width - plan.head_slots.size  # where the window starts: p, or the chunk
        seq.window_tokens = np.where(fills, tokens, plan.tokens[window:]).astype(np.int32)
        seq.window_filled = plan.filled[window:] | fills
        return plan.commits

    def launch_ahead(
        self, room: AheadRoom, flight: Flight, fills: mx.array, tokens: mx.array
    ) -> AheadForward | None:
        """For a micro-batch of WeDLM decode rows, the next forward from this step's
        selection before reading it back: the device computes step t+1 while the host
        reads step t and postprocesses it. Only where every layer runs in this process
        (workers take a forward's kept rows with the forward)."""
        if not room.keeps_later or room.prefill(flight):
            return None
        live = [i for i, p in enumerate(flight.plans) if not p.seq.finished]
        plans = [flight.plans[i] for i in live]
        if not plans or not all(window_decoding(p) for p in plans):
            return None
        constrained_rows = {p.seq.seq_id for p in plans if p.seq.matcher is not None}
        if constrained_rows and (not room.constrained_ahead or constrained_rows & room.cut):
            return None  # the grammar cut a run at the last step: it may well cut again
        if room.chain_breaks(flight, plans):
            return None
        if all(len(p.seq.output) + len(p.commits) >= p.seq.params.max_tokens for p in plans):
            return None  # every row ends at this step
        width = padded_width(2 * max(p.head_slots.size for p in plans))
        if any(p.seq.kv_length + p.keep + width > room.ctx.max_positions for p in plans):
            return None
        padding = room.padding_ids(flight, len(plans))
        if live != list(range(len(live))):  # rows that finished drop out (else: a prefix,
            rows = mx.array(live)  # which next_inputs slices for free)
            fills, tokens = fills[rows], tokens[rows]
        ids, filled = next_inputs(
            plans, fills, tokens, room.ctx.mask_token_id, width, len(padding)
        )
        b = len(plans) + len(padding)
        host_filled = np.zeros((b, width), dtype=bool)  # on the device only: `visibility`
        spec = ahead_spec(plans, padding, width, host_filled, compiled_device_visibility(filled))
        return AheadForward(plans, spec, ids)  # plans of step t stand in until resolved


def window_decoding(plan: RowPlan) -> bool:
    """A WeDLM window row (its sequence past its prompt)."""
    seq = plan.seq
    return seq.phase is Phase.DECODE and seq.params.mode == Mode.WEDLM and plan.head_slots.size > 0


def plan_wedlm(seq: Sequence, mask_token_id: int) -> RowPlan:
    """Refill first: p leading filled slots will commit, so p new masks join the window.
    Logits are needed for the W slots that remain after the commit."""
    p = seq.leading_filled()
    w = seq.params.window
    filled = np.concatenate([seq.window_filled, np.zeros(p, dtype=bool)])
    tokens = np.concatenate([seq.window_tokens, np.full(p, mask_token_id, np.int32)])
    tokens = np.where(filled, tokens, mask_token_id).astype(np.int32)
    return RowPlan(
        seq=seq,
        tokens=tokens,
        filled=filled,
        keep=p,
        head_slots=np.arange(p, p + w),
        head_is_mask=~filled[p : p + w],
        commits=[int(t) for t in tokens[:p]],
    )


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
