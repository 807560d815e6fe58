"""How many drafts each speculative request's next forward may carry: drafts that never
cost speed.

A drafting forward (1 + k drafts + m mask slots rows per sequence) costs `break_even` AR
forwards (one row, launched ahead of the last one's read-back); the engine measures that
ratio on its own machine and model (step_cost.py). A request drafts only while its recent
gain, the EMA of tokens committed per drafting forward, exceeds the break-even; otherwise
its limit is 0 and it decodes as AR, with AR's look-ahead. Within drafting, the limit
follows acceptance: doubled while every draft is accepted, cut to what was accepted when
fewer than half are (to 0 when none is), halved when nothing was confident enough to draft.

A drafting forward commits at most window + 1 tokens: where the break-even is at least
that (a CPU's multi-row forwards can cost 10x a one-row one), drafts can never pay and the
request decodes as AR from its first forward, with no probes.

At 0 a probe (one draft; with mask drafts, a forward with mask slots, then one verifying
its confident slot) tests whether drafts are accepted again. A probe whose draft is
accepted resumes drafting; a probe that fails, or a resumed spell that ends without ever
paying, doubles the gap to the next probe (PROBE_EVERY, 2x, 4x, ... up to PROBE_MAX
forwards); a spell that paid resets it. Where drafts never pay, the probes cost a few
percent. Drafts never change tokens: the output is AR's whatever the limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.engine.row_plan import RowPlan
    from coordinator.engine.sequence import Sequence

PROBE_EVERY = 8  # forwards from drafts turning off to the first probe
PROBE_MAX = 128  # the longest gap between probes
PROBE_DRAFTS = 1
GAIN_WEIGHT = 0.3  # of the newest drafting forward in the gain's EMA


@dataclass
class DraftState:
    gain: float | None = None  # EMA of tokens committed per drafting forward (this spell)
    gap: int = PROBE_EVERY  # forwards between probes while drafts are off
    next_probe: int = 0  # the forward number (Sequence.forwards) of the next probe
    paid: bool = True  # drafting paid since it last resumed (the first spell counts as paid)


def adapt_draft_limit(
    seq: Sequence, drafted: int, accepted: int, break_even: float = 1.0, extra_rows: int = -1
) -> None:
    """After a verifying forward of `seq` (Sequence.forwards counts it already) that carried
    `drafted` drafts, `accepted` of them accepted, and `extra_rows` rows past its pending
    ones (drafts and mask slots; -1: as many as drafts)."""
    state = seq.draft_state
    extra = drafted if extra_rows < 0 else extra_rows
    limit = seq.params.window if seq.draft_limit is None else seq.draft_limit
    if limit == 0:
        if extra:  # a probe
            _probed(seq, drafted, accepted)
        return
    if not can_pay(seq, break_even):
        seq.draft_limit = 0
        return
    if extra:
        sample = accepted + 1
        gain = state.gain
        state.gain = sample if gain is None else GAIN_WEIGHT * sample + (1 - GAIN_WEIGHT) * gain
    if drafted and accepted == drafted:
        limit = max(1, 2 * limit)
    elif drafted and 2 * accepted < drafted:
        limit = accepted
    elif not drafted and seq.forwards > 1:  # nothing confident enough to draft
        limit //= 2
    if drafted:
        if state.gain is not None and state.gain <= break_even:
            limit = 0  # drafting costs more than it commits
        elif accepted + 1 > break_even:
            state.paid = True
    seq.draft_limit = min(limit, seq.params.window)
    if seq.draft_limit == 0:
        state.gap = PROBE_EVERY if state.paid else min(2 * state.gap, PROBE_MAX)
        state.next_probe = seq.forwards + state.gap


def _probed(seq: Sequence, drafted: int, accepted: int) -> None:
    state = seq.draft_state
    if drafted and accepted == drafted:  # accepted again: a new spell, judged afresh
        seq.draft_limit = 2 * drafted
        state.gain, state.paid = None, False
    elif not drafted and seq.drafts.size:  # mask slots drafted: the next forward verifies
        state.next_probe = seq.forwards + 1
    else:
        state.gap = min(2 * state.gap, PROBE_MAX)
        state.next_probe = seq.forwards + state.gap


def can_pay(seq: Sequence, break_even: float) -> bool:
    """Whether a drafting forward of `seq` could pay at all: at most window + 1 tokens."""
    return break_even < seq.params.window + 1


def draft_room(seq: Sequence, break_even: float = 1.0) -> int:
    """How many drafts (and mask slots) `seq`'s next forward may carry."""
    limit = seq.draft_limit
    if not can_pay(seq, break_even):
        return 0
    if limit is None:
        return seq.params.window
    if limit == 0 and seq.forwards + 1 >= seq.draft_state.next_probe:
        return PROBE_DRAFTS
    return limit


def drafts_off(plan: RowPlan, break_even: float = 1.0) -> bool:
    """Whether a speculative row, read back but not yet postprocessed, and its next forward
    carry one row each (no drafts, no mask slots): the request then decodes as AR, and the
    next forward may be AR's look-ahead (engine._launch_ahead)."""
    seq = plan.seq
    if plan.width != 1:
        return False
    if not can_pay(seq, break_even):
        return True
    return seq.draft_limit == 0 and seq.forwards + 2 < seq.draft_state.next_probe
