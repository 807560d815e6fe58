"""AR's look-ahead: the next forward of a decode micro-batch planned before step t is read
back, from the one token each row commits at t (engine._launch_ahead feeds that token
from the device, as mlx-lm does).

A row qualifies when what t commits cannot change its next forward's shape: an AR row; a
speculative row that ran one row and whose draft state its postprocess leaves as it was
(row_plan.unchanged_by_postprocess); a mask probe (row_plan.probe_ends), whose next
forward is one row. The next forward carries mask slots only for probes with mask drafts
(a probe needs no token of t's beyond the one fed: its slots are masks), so probes ride
the chain too. A batch whose rows would carry drafts of their own (a spell, or rows held
back that the batch now lets draft) waits for the regular launch, which plans them."""

from __future__ import annotations

import numpy as np

from common.modes import Mode
from coordinator.engine.draft_policy import batch_rooms, draft_room
from coordinator.engine.row_plan import RowPlan, probe_ends, unchanged_by_postprocess
from coordinator.engine.sequence import Phase, Sequence


def next_plans(
    plans: list[RowPlan], break_even: float, mask_token_id: int, max_positions: int
) -> list[RowPlan] | None:
    """The next forward's plans for the rows of `plans` (none finished), with a
    placeholder where t's token goes, or None when one depends on what t commits."""
    if not all(
        ar_decoding(p.seq) or (speculative(p.seq) and _one_row_next(p, break_even)) for p in plans
    ):
        return None
    seqs = [p.seq for p in plans]
    if any(probe_ends(p) for p in plans):  # no probe right after a probe
        rooms = [0] * len(plans)
    else:
        rooms = batch_rooms(seqs, break_even, ahead=1)
    nxt = []
    for plan, room in zip(plans, rooms, strict=True):
        seq = plan.seq
        if room and seq.draft_limit != 0:
            return None  # the batch drafts: the regular launch plans its drafts
        if room and seq.params.draft != "mask":
            return None  # lookup and model drafts are made from t's token on the host
        own = 0
        if speculative(seq) and not probe_ends(plan):
            own = draft_room(seq, break_even, ahead=1)
        nxt.append(_after_one(seq, room, own, mask_token_id, max_positions))
    return nxt


def _one_row_next(plan: RowPlan, break_even: float) -> bool:
    return unchanged_by_postprocess(plan, break_even) or probe_ends(plan)


def _after_one(
    seq: Sequence, room: int, own: int, mask_token_id: int, max_positions: int
) -> RowPlan:
    """What row_plan.plan_next makes for `seq` once t has committed one token, its draft
    state unchanged and no drafts pending: one row, or a probe of `room` drafts' mask
    slots (plan_speculative's count, one position and one token later)."""
    m = 0
    if room:
        remaining = seq.params.max_tokens - len(seq.output) - 1
        fit = max_positions - (seq.kv_length + 1) - 1
        m = max(min(room + 1, seq.params.window, remaining - 1, fit), 0)
    tokens = np.full(1 + m, mask_token_id, np.int32)
    tokens[0] = 0  # t's token, fed from the device
    ar = seq.params.mode == Mode.AR
    return RowPlan(
        seq=seq,
        tokens=tokens,
        filled=np.arange(1 + m) < 1,
        keep=1,
        head_slots=np.arange(1 + m),
        # an AR row fills its one slot; a speculative row's slots past the first are masks
        head_is_mask=np.ones(1, bool) if ar else np.arange(1 + m) > 0,
        held=room == 0 < own,
    )


def speculative(seq: Sequence) -> bool:
    return seq.phase is Phase.DECODE and seq.params.mode == Mode.SPECULATIVE


def ar_decoding(seq: Sequence) -> bool:
    """An autoregressive sequence past its prompt, with its next input token known."""
    return seq.phase is Phase.DECODE and seq.params.mode == Mode.AR and bool(seq.output)
