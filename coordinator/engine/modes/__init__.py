"""The decoding modes, one module each (ar.py, wedlm.py, speculative.py; block diffusion's
canvases are an engine of their own, coordinator/engine/diffusion/), behind one interface
(base.py's DecodingMode), registered by name (registry.py). What the scheduler and the
engine ask of a row goes through here: its next forward's plan (a prompt chunk, or the
mode's decode rows), the tokens a forward commits, and the look-ahead launches."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np

from coordinator.engine.modes.ar import ArMode
from coordinator.engine.modes.base import AheadForward, AheadRoom, DecodingMode, Flight, PlanContext
from coordinator.engine.modes.registry import mode_of, register, registered, served
from coordinator.engine.modes.speculative import SpeculativeMode
from coordinator.engine.modes.wedlm import WedlmMode
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Phase, Sequence

__all__ = [
    "AheadForward", "AheadRoom", "DecodingMode", "Flight", "PlanContext", "apply_result",
    "launch_ahead", "mode_of", "plan_next", "plan_prefill", "register", "registered", "served",
]  # fmt: skip

# AR first: its look-ahead also carries speculative rows that run one row (ar.next_plans)
for _mode in (ArMode(), WedlmMode(), SpeculativeMode()):
    register(_mode)

_NONE = np.zeros(0, dtype=np.int64)


def plan_next(seq: Sequence, ctx: PlanContext, room: int | None = None) -> RowPlan:
    """`seq`'s next forward: its prompt's next chunk, or its mode's decode rows. `room`:
    a speculative row's drafts as its batch decided (draft_policy.batch_rooms)."""
    if seq.phase in (Phase.WAITING, Phase.PREFILL):
        return plan_prefill(seq, ctx.prefill_chunk, ctx)
    return mode_of(seq.params.mode).plan(seq, ctx, room)


def plan_prefill(seq: Sequence, chunk: int, ctx: PlanContext | None = None) -> RowPlan:
    """The next chunk of the prompt (or of the history being rebuilt); AR needs the last
    prompt row's logits, a rebuild needs none. With `ctx`, the prompt's last chunk also
    opens decoding where the mode can (DecodingMode.opening). A request that asks for its
    prompt's logprobs also scores each row whose next token is in the prompt."""
    plan = _prefill_rows(seq, chunk, ctx and replace(ctx, prefill_chunk=chunk))
    if seq.params.prompt_logprobs and not seq.rebuild_to:
        start = seq.prefilled
        scored = min(plan.keep, len(seq.prompt) - 1 - start)
        plan.score_slots = np.arange(max(scored, 0))
        plan.score_start = start + 1
    return plan


def _prefill_rows(seq: Sequence, chunk: int, ctx: PlanContext | None) -> RowPlan:
    start = seq.prefilled
    source = seq.prefill_tokens()
    tokens = np.asarray(source[start : start + chunk], dtype=np.int32)
    last = start + tokens.size == len(source)
    mode = mode_of(seq.params.mode) if served(seq.params.mode) else None
    if last and ctx is not None and mode is not None and not seq.rebuild_to and tokens.size:
        opening = mode.opening(seq, tokens, ctx)
        if opening is not None:
            return opening
    wants_head = last and not seq.rebuild_to and (mode is None or mode.first_token_from_prompt())
    head = np.array([tokens.size - 1]) if wants_head else _NONE
    return RowPlan(
        seq=seq,
        tokens=tokens,
        filled=np.ones(tokens.size, dtype=bool),
        keep=int(tokens.size),
        head_slots=head,
        head_is_mask=np.ones(head.size, dtype=bool),
    )


def apply_result(
    plan: RowPlan, fills: np.ndarray, tokens: np.ndarray, break_even: float = 1.0
) -> tuple[list[int], Phase]:
    """Postprocess one sequence after its forward: the tokens it committed, and the phase
    it is in now (the scheduler sets it). `break_even`: what a drafting forward costs in
    AR forwards, for speculative rows (draft_policy.py)."""
    seq = plan.seq
    mode = mode_of(seq.params.mode)
    seq.kv_length += plan.keep
    before = len(seq.output)
    if seq.phase is not Phase.DECODE:
        seq.prefilled += plan.keep
        if seq.prefilled < len(seq.prefill_tokens()):
            return [], Phase.PREFILL
        if seq.rebuild_to:  # history rebuilt: decoding resumes where it stopped
            seq.rebuild_to = 0
            return [], Phase.DECODE
        if not mode.prefilled(seq, plan):
            return [], Phase.DECODE
    seq.forwards += 1
    end = seq.commit(mode.commit(plan, fills, tokens, break_even))
    return seq.output[before:], end or Phase.DECODE


def launch_ahead(
    room: AheadRoom, flight: Flight, fills: mx.array, tokens: mx.array
) -> AheadForward | None:
    """The first look-ahead forward a mode builds for this micro-batch (None: none)."""
    for mode in registered():
        if not room.allows(mode.name):
            continue
        ahead = mode.launch_ahead(room, flight, fills, tokens)
        if ahead is not None:
            return ahead
    return None
