"""How many drafts each speculative row of a decode micro-batch carries in its next
forward: drafts that never cost speed.

A drafting forward (1 + k drafts + m mask slots rows per sequence) costs `break_even` AR
forwards (one row, launched ahead of the last one's read-back); the engine measures that
ratio per row bucket on its own machine and model (step_cost.py).

Each request keeps its own state: its gain, the EMA of tokens committed per drafting
forward, and a draft limit that follows acceptance (doubled while every draft is accepted,
cut to what was accepted when fewer than half are, to 0 when none is, halved when nothing
was confident enough to draft). Its drafts turn off (limit 0) when its gain falls to the
break-even.

The decision is made for the micro-batch (`batch_rooms`), because a forward is as wide as
its widest row: one drafting row makes the forward of all B rows a drafting forward, and
costs every row AR's look-ahead. So the batch drafts only when the tokens it expects to
commit with drafts, per row, exceed break_even(B): the sum over rows of each drafting
row's gain, and 1 for every other row (AR requests, speculative rows with drafts off),
divided by B. Otherwise no row drafts this forward: the batch decodes as AR, with AR's
look-ahead, and the rows it held back keep their state as it was (`RowPlan.held`). When the
batch drafts, every row whose limit allows carries its drafts: the width is paid anyway.
A row of a WeDLM request makes the forward wide whatever the others do: they draft freely.

Exploration is the exception: a probe, or the forwards of a spell before its gain is known
(a new request, or one whose probe was just accepted), make the batch draft. A probe
tests whether a request whose drafts are off is accepted again: accepted, drafting
resumes; failed, or a resumed spell that ends without ever paying, the gap to its next
probe doubles (PROBE_EVERY, 2x, 4x, ... up to PROBE_MAX forwards); a spell that paid resets
it. With lookup or model drafts a probe is one forward with one draft. With mask drafts it
is one forward with mask slots, launched ahead like AR's forwards (engine._launch_ahead):
its confident slot's token (the guess for the position after the token it commits) is not
verified by a drafting forward but checked against the token the next forward, one row,
commits there (`settle_shadow`): that is the model's own choice given the same text, so
the check is the verification's, and the chain of look-ahead forwards never breaks.
Because exploring widens the whole batch, in a batch of several rows it waits for the
batch's probe slot, and every row due by then explores in it together; a request's first
forward and one verifying drafts its mask slots made do not wait. A batch of B rows
explores about as often as one row would: its slot comes every g * B forwards (at most
PROBE_MAX), g the shortest probe gap among its rows whose drafts are off (PROBE_EVERY while
none is), so slots also back off as their probes fail.

A drafting forward commits at most window + 1 tokens: where the break-even is at least
that (a CPU's multi-row forwards can cost 10x a one-row one), drafts can never pay and the
request decodes as AR from its first forward, with no probes. Drafts never change tokens:
the output is AR's whatever the batch decides."""

from __future__ import annotations

from common.modes import Mode
from coordinator.engine.draft_state import PROBE_EVERY, PROBE_MAX
from coordinator.engine.sequence import Sequence

PROBE_DRAFTS = 1
GAIN_WEIGHT = 0.3  # of the newest drafting forward in the gain's EMA


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
    if extra and (drafted or state.gain is not None):  # a spell's gain starts at its
        sample = accepted + 1  # first drafts (mask slots alone cannot commit more)
        gain = state.gain
        state.gain = sample if gain is None else GAIN_WEIGHT * sample + (1 - GAIN_WEIGHT) * gain
    if drafted and accepted == drafted:
        limit = max(1, 2 * limit)
    elif drafted and 2 * accepted < drafted:
        limit = accepted
    elif not drafted and (extra or seq.params.draft != "mask"):
        limit //= 2  # nothing to draft: no lookup match, or mask slots none confident
        # (the prompt's own mask slots too: row_plan.plan_opening). Mask slots that found
        # a confident run halve it too: keeping the limit for their verification (RESULTS
        # SC13) halved speculative counting on the GPU, 2.8x AR to 1.4x (SC14)
        # (a mask row's one-row forward had no slots: a look-ahead launched before a
        # resume, settle_shadow)
    if extra and state.gain is not None and state.gain <= break_even:
        # drafting costs more than it commits (a forward of mask slots that drafted
        # nothing counts too: held back by its batch alone, the row would never draft
        # nor probe again)
        limit = 0
    elif drafted and accepted + 1 > break_even:
        state.paid = True
    seq.draft_limit = min(limit, seq.params.window)
    if seq.draft_limit == 0:
        state.gap = PROBE_EVERY if state.paid else min(2 * state.gap, PROBE_MAX)
        state.next_probe = seq.forwards + state.gap


def _probed(seq: Sequence, drafted: int, accepted: int) -> None:
    """After a probe, before its tokens are committed (one when it carried no draft)."""
    state = seq.draft_state
    if drafted and accepted == drafted:  # accepted again: a new spell, judged afresh
        _resume(seq, drafted)
    elif not drafted and seq.drafts.size:  # a confident mask slot: checked next forward
        state.shadow = (len(seq.output) + 1, int(seq.drafts[0]))
        seq.drafts = seq.drafts[:0]
        state.next_probe = seq.forwards + state.gap
    else:
        _back_off(seq)


def settle_shadow(seq: Sequence, tokens: list[int]) -> None:
    """A forward commits `tokens` from output index len(seq.output) on: where a mask probe
    guessed one of those indices, the guess is settled as its verification would be
    (module docstring)."""
    state = seq.draft_state
    if state.shadow is None:
        return
    index, guess = state.shadow
    offset = index - len(seq.output)
    if offset >= len(tokens):
        return  # not reached yet
    state.shadow = None
    if offset >= 0 and tokens[offset] == guess:
        _resume(seq, 1)
    else:  # a wrong guess (or one whose index went by unchecked: not expected)
        _back_off(seq)


def _resume(seq: Sequence, drafted: int) -> None:
    seq.draft_limit = 2 * drafted
    seq.draft_state.gain, seq.draft_state.paid = None, False


def _back_off(seq: Sequence) -> None:
    state = seq.draft_state
    state.gap = min(2 * state.gap, PROBE_MAX)
    state.next_probe = seq.forwards + state.gap


def can_pay(seq: Sequence, break_even: float) -> bool:
    """Whether a drafting forward of `seq` could pay at all: at most window + 1 tokens."""
    return break_even < seq.params.window + 1


def draft_room(seq: Sequence, break_even: float = 1.0, ahead: int = 0) -> int:
    """How many drafts (and mask slots) `seq`'s next forward may carry by its own state
    (`ahead`: of the forward after that one, predicted before the next is postprocessed)."""
    limit = seq.draft_limit
    if not can_pay(seq, break_even):
        return 0
    if limit is None:
        return seq.params.window
    state = seq.draft_state
    if limit == 0 and seq.forwards + 1 + ahead >= state.next_probe and state.shadow is None:
        return PROBE_DRAFTS
    return limit


def batch_rooms(seqs: list[Sequence], break_even: float, ahead: int = 0) -> list[int]:
    """The drafts (and mask slots) each row of a decode micro-batch of these sequences
    carries in its next forward: every row's own room when the batch drafts, all 0 when it
    does not (the module docstring). `break_even`: a drafting forward of len(seqs) rows in
    AR forwards; `ahead` as in draft_room."""
    if not seqs:
        return []
    slot = _probe_slot(seqs, ahead)
    rooms, value, explore = [], 0.0, False
    for seq in seqs:
        room = draft_room(seq, break_even, ahead) if seq.params.mode == Mode.SPECULATIVE else 0
        if room and _waits(seq, ahead) and not slot:
            room = 0
        rooms.append(room)
        explore |= seq.params.mode == Mode.WEDLM  # a wide forward anyway: drafts cost nothing
        gain = seq.draft_state.gain
        if not room:
            value += 1.0
        elif seq.draft_limit == 0 or gain is None:
            explore = True  # a probe, or a spell's first forwards: no gain known yet
        else:
            value += gain
    if explore or value > break_even * len(seqs):
        return rooms
    return [0] * len(seqs)


def _probe_slot(seqs: list[Sequence], ahead: int) -> bool:
    """Whether the batch's next forward may explore (module docstring): always for one row;
    for B rows, every min(g * B, PROBE_MAX)-th forward, g the shortest probe gap among rows
    whose drafts are off (PROBE_EVERY while none is)."""
    if len(seqs) == 1:
        return True
    clock = max(s.forwards for s in seqs) + 1 + ahead  # the batch's next forward number
    gap = min((s.draft_state.gap for s in seqs if s.draft_limit == 0), default=PROBE_EVERY)
    return clock % min(gap * len(seqs), PROBE_MAX) == 0


def _waits(seq: Sequence, ahead: int) -> bool:
    """Whether a row's drafting forward is exploration that waits for its batch's probe
    slot: a probe, or a spell whose gain is not known yet; not a request's first forward,
    nor one that verifies drafts its mask slots made (they are gone after one forward;
    after a one-row forward, whose postprocess `ahead` predicts, there are none)."""
    if seq.draft_limit is None or (seq.drafts.size and not ahead):
        return False
    return seq.draft_limit == 0 or seq.draft_state.gain is None
