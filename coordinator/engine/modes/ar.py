"""Autoregressive decoding: one row per forward, the last committed token fed, the next one
chosen from its logits.

Its look-ahead: the next forward of a decode micro-batch planned before step t is read
back, from the one token each row commits at t (ArMode.launch_ahead feeds that token
from the device, as mlx-lm does).

A row qualifies when what t commits cannot change its next forward's shape: an AR row; a
speculative row that ran one row and whose draft state its postprocess leaves as it was
(speculative.unchanged_by_postprocess); a mask probe (speculative.probe_ends), whose next
forward is one row. The next forward carries mask slots only for probes with mask drafts
(a probe needs no token of t's beyond the one fed: its slots are masks), so probes ride
the chain too. A batch whose rows would carry drafts of their own (a spell, or rows held
back that the batch now lets draft) waits for the regular launch, which plans them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.modes import Mode
from coordinator.engine.draft_policy import batch_rooms, draft_room
from coordinator.engine.modes.base import AheadForward, AheadRoom, DecodingMode, Flight, PlanContext
from coordinator.engine.modes.speculative import probe_ends, unchanged_by_postprocess
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Phase, Sequence
from coordinator.engine.tick_batch import build_batch


class ArMode(DecodingMode):
    name = Mode.AR

    def plan(self, seq: Sequence, ctx: PlanContext, room: int | None) -> RowPlan:
        return plan_autoregressive(seq)

    def launch_ahead(
        self, room: AheadRoom, flight: Flight, fills: mx.array, tokens: mx.array
    ) -> AheadForward | None:
        """For a micro-batch of autoregressive decode rows, the next forward from the
        sampled tokens before reading them back, as mlx-lm does: the device computes step
        t+1 while the host checks stops of step t (mask probes of speculative rows ride it
        too: next_plans). A row that stops at t wastes one row of t+1 (its KV past the end
        is stale and released). Sequences that joined the group since (their prefill just
        ended) join this forward: their next input is already on the host, so arrivals do
        not break the chain."""
        live = [i for i, p in enumerate(flight.plans) if not p.seq.finished]
        plans = [flight.plans[i] for i in live]
        if not plans or room.prefill(flight):
            return None
        limit = room.ctx.max_positions
        be = room.step_cost.break_even(len(plans))
        own = next_plans(plans, be, room.ctx.mask_token_id, limit)
        if own is None:
            return None
        joiners = room.joiners(flight, plans)
        if joiners is None or not all(ar_decoding(s) for s in joiners):
            return None  # a row left the group: the next regular launch takes everyone
        if room.slot_owed(flight):
            return None  # the slot is owed to a prefill or another group: no starving
        if not joiners and all(len(p.seq.output) + 1 >= p.seq.params.max_tokens for p in plans):
            return None  # every row ends at this step
        if any(p.seq.kv_length + 1 + n.width > limit for p, n in zip(plans, own, strict=True)):
            return None
        if any(s.kv_length + 1 > limit for s in joiners):
            return None
        nxt = own + [plan_autoregressive(s) for s in joiners]
        batch = build_batch(nxt, padding_ids=room.padding_ids(flight, len(nxt)))
        batch.spec.starts[: len(plans)] += 1  # after step t's row becomes permanent
        ids = tokens[mx.array(live), :1]
        if joiners:  # their first token came back with their prefill
            last = mx.array([[s.output[-1]] for s in joiners], dtype=ids.dtype)
            ids = mx.concatenate([ids, last])
        pad = batch.tokens.shape[0] - ids.shape[0]
        if pad:
            ids = mx.concatenate([ids, mx.zeros((pad, 1), ids.dtype)])
        if batch.tokens.shape[1] > 1:  # a probe's mask slots (and padding past rows' ends)
            ids = mx.concatenate([ids.astype(mx.int32), mx.array(batch.tokens[:, 1:])], axis=1)
        return AheadForward(nxt, batch.spec, ids, batch=batch)


def plan_autoregressive(seq: Sequence) -> RowPlan:
    """Feed the last committed token; its K/V become permanent; its logits give the next."""
    return RowPlan(
        seq=seq,
        tokens=np.array([seq.output[-1]], dtype=np.int32),
        filled=np.ones(1, dtype=bool),
        keep=1,
        head_slots=np.zeros(1, dtype=np.int64),
        head_is_mask=np.ones(1, dtype=bool),
    )


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
    """What modes.plan_next makes for `seq` once t has committed one token, its draft
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
