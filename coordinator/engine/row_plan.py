"""What one sequence contributes to the next forward: its rows, their visibility, how many
of them become permanent KV, and which rows' logits the coordinator needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.modes import Mode
from coordinator.engine.draft_policy import (  # noqa: F401 (batch_rooms, draft_room: re-exported)
    adapt_draft_limit,
    batch_rooms,
    can_pay,
    draft_room,
    settle_shadow,
)
from coordinator.engine.draft_state import PROBE_EVERY  # noqa: F401 (the policy's, re-exported)
from coordinator.engine.prompt_lookup import prompt_lookup
from coordinator.engine.sequence import Phase, Sequence


@dataclass
class RowPlan:
    seq: Sequence
    tokens: np.ndarray  # [T] input ids in logical slot order (mask slots hold the mask id)
    filled: np.ndarray  # [T] False for mask slots
    keep: int  # leading rows that become permanent KV after this forward
    head_slots: np.ndarray  # [K] rows whose logits are needed
    head_is_mask: np.ndarray  # [K] which of those may be filled this step
    commits: list[int] = field(default_factory=list)  # tokens committed by this forward
    drafts: int = 0  # speculative mode: draft rows after the `keep` pending ones
    # speculative mode: its own state would draft, but its batch does not this forward
    # (draft_policy.batch_rooms); its draft state is left as it was
    held: bool = False
    canvas: int = 0  # diffusion mode: trailing slots that are a canvas (bidirectional)
    offsets: np.ndarray | None = None  # compacted canvas: each slot's canvas position
    extent: int = 0  # compacted canvas: its length (positions the slots see)
    # the prompt's last chunk carrying the first decode step's mask slots (plan_opening)
    opens: bool = False
    # params.prompt_logprobs: prompt rows whose logits score the next prompt token, which
    # sits at prompt index score_start + j for score slot j (the head runs on them apart)
    score_slots: np.ndarray = field(default_factory=lambda: _NONE)
    score_start: int = 0

    @property
    def width(self) -> int:
        return int(self.tokens.size)

    @property
    def decodes(self) -> bool:
        """Whether this forward runs a decode step of its sequence: a decode row's, or a
        prompt's last chunk opening decoding (plan_opening). Read before postprocess."""
        return self.seq.phase is Phase.DECODE or self.opens


_NONE = np.zeros(0, dtype=np.int64)


def plan_prefill(
    seq: Sequence,
    chunk: int,
    mask_token_id: int | None = None,
    max_positions: int = 0,
    break_even: float = 1.0,
) -> RowPlan:
    """The next chunk of the prompt (or of the history being rebuilt); AR needs the last
    prompt row's logits, a rebuild needs none. With `mask_token_id`, the prompt's last
    chunk also opens decoding where it can (plan_opening). A request that asks for its
    prompt's logprobs also scores each row whose next token is in the prompt."""
    plan = _prefill_rows(seq, chunk, mask_token_id, max_positions, break_even)
    if seq.params.prompt_logprobs and not seq.rebuild_to:
        start = seq.prefilled
        scored = min(plan.keep, len(seq.prompt) - 1 - start)
        plan.score_slots = np.arange(max(scored, 0))
        plan.score_start = start + 1
    return plan


def _prefill_rows(
    seq: Sequence,
    chunk: int,
    mask_token_id: int | None,
    max_positions: int,
    break_even: float,
) -> RowPlan:
    start = seq.prefilled
    source = seq.prefill_tokens()
    tokens = np.asarray(source[start : start + chunk], dtype=np.int32)
    last = start + tokens.size == len(source)
    if last and mask_token_id is not None and not seq.rebuild_to:
        opening = plan_opening(seq, tokens, chunk, mask_token_id, max_positions, break_even)
        if opening is not None:
            return opening
    # AR and speculative mode take their first token from the last prompt row
    wants_head = last and seq.params.mode != Mode.WEDLM and not seq.rebuild_to
    head = np.array([tokens.size - 1]) if wants_head else _NONE
    return RowPlan(
        seq=seq,
        tokens=tokens,
        filled=np.ones(tokens.size, dtype=bool),
        keep=int(tokens.size),
        head_slots=head,
        head_is_mask=np.ones(head.size, dtype=bool),
    )


def plan_opening(
    seq: Sequence,
    chunk_tokens: np.ndarray,
    chunk: int,
    mask_token_id: int,
    max_positions: int,
    break_even: float,
) -> RowPlan | None:
    """The prompt's last chunk with the first decode step's mask slots after it, in one
    forward (None where they do not fit: the chunk's width, the context). The mask rows see
    the whole prompt, as they would in a forward of their own once its KV is stored, so
    this saves that forward:
    - WeDLM: the first window, W masks (the decoding spec's step 1: the prompt's logits
      are still discarded, only the masks' are read);
    - speculative with mask drafts: the last prompt row chooses the first token as AR's
      does, and the mask slots after it draft the next ones (plan_speculative with the
      chunk as its pending rows), so the first decode forward can verify drafts at once.
    A forward of a whole chunk is wide anyway: the slots cost it little."""
    mode = seq.params.mode
    if not chunk_tokens.size:
        return None  # nothing left to run (not expected: a cache hit leaves one row)
    if mode == Mode.WEDLM:
        c, w = chunk_tokens.size, seq.params.window
        if c + w > chunk or seq.kv_length + c + w > max_positions:
            return None
        return RowPlan(
            seq=seq,
            tokens=np.concatenate([chunk_tokens, np.full(w, mask_token_id, np.int32)]),
            filled=np.arange(c + w) < c,
            keep=c,
            head_slots=np.arange(c, c + w),
            head_is_mask=np.ones(w, dtype=bool),
            opens=True,
        )
    if mode != Mode.SPECULATIVE or seq.params.draft != "mask" or seq.draft_limit is not None:
        return None  # only a new request's first exploration (draft_policy.py)
    plan = plan_speculative(
        seq, mask_token_id, max_positions, "mask", break_even, pending=chunk_tokens
    )
    if plan.width == plan.keep or plan.width > chunk:
        return None  # no mask slot (drafts cannot pay, or one token to go) or no room
    plan.opens = True
    return plan


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


# Speculative (verified) decoding: several tokens per forward, exactly the autoregressive output.
#
# A forward of a speculative sequence feeds, from its committed KV length on:
#   pending  the committed tokens whose KV is not stored yet (at least the last one),
#   drafts   k proposed continuations,
#   masks    m mask slots (mask-slot drafting only),
# in natural order with causal visibility over the filled run (common/window_mask.py). The
# rows of the last pending token and of every draft give the model's own next-token choice at
# each position; the longest run of drafts equal to those choices is accepted, and the choice
# at the first mismatch (or after the last draft) is committed too, so every forward commits
# at least one token. Tokens are chosen as autoregressive decoding chooses them (argmax, or a
# draw keyed by the output index: see sampling.py), so the output is AR's token for token.
#
# With point-mass drafts the speculative-sampling rule (accept d with probability p(d), else
# draw from p with d removed) is exactly "draw from p; accept when the draw equals d": a
# Gumbel-max draw equals d with probability p(d), and otherwise is distributed as p without d.
#
# Accepted drafts are committed tokens; like WeDLM's filled run their KV is stored by the next
# forward, which feeds them as its pending rows (no protocol change, no rollback of KV). The
# mask slots predict the tokens at their own positions (WeDLM-trained models): after a forward
# whose drafts were all accepted, the confident leading run of them is the next forward's
# drafts, conditioned on text that is now committed.


def plan_speculative(
    seq: Sequence,
    mask_token_id: int,
    max_positions: int,
    source: str,
    break_even: float = 1.0,
    room: int | None = None,
    pending: np.ndarray | None = None,
) -> RowPlan:
    """The rows of one verifying forward; `source` is the resolved draft source,
    `break_even` a drafting forward's cost in AR forwards, `room` the drafts its batch
    lets it carry (draft_policy.batch_rooms; None: its own draft room). `pending`: rows
    whose KV is not stored yet (default: the committed tokens past the KV; the prompt's
    last chunk for plan_opening)."""
    if pending is None:
        pending = np.asarray(seq.pending(), dtype=np.int32)
    own = draft_room(seq, break_even)
    limit = own if room is None else min(room, own)
    remaining = seq.params.max_tokens - len(seq.output)
    room = max_positions - seq.kv_length - pending.size  # rows that fit in the context
    if source == "lookup":
        history = np.asarray(seq.prompt + seq.output, dtype=np.int32)
        drafts = prompt_lookup(history, limit)
    else:  # mask-slot predictions or the draft model's proposals, set beforehand
        drafts = seq.drafts
    # Drafts past the last token the request may commit can never count.
    k = max(min(drafts.size, limit, remaining - 1, room), 0)
    drafts = np.asarray(drafts[:k], dtype=np.int32)
    # Mask slots draft the next forward; it may commit up to remaining - k - 1 tokens.
    # slot 0 sits where the committed choice goes: `limit` drafts need limit + 1 slots
    slots = min(limit + 1, seq.params.window) if limit else 0
    m = max(min(slots, remaining - k - 1, room - k), 0) if source == "mask" else 0
    c = pending.size
    tokens = np.concatenate([pending, drafts, np.full(m, mask_token_id, np.int32)])
    return RowPlan(
        seq=seq,
        tokens=tokens.astype(np.int32),
        filled=np.arange(tokens.size) < c + k,
        keep=c,
        # the next-token choices at the last pending row and every draft, then the masks
        head_slots=np.arange(c - 1, c + k + m),
        head_is_mask=np.arange(k + 1 + m) > k,
        drafts=k,
        held=limit == 0 < own,
    )


def accept_speculative(
    plan: RowPlan, fills: np.ndarray, tokens: np.ndarray, break_even: float = 1.0
) -> list[int]:
    """The tokens this forward commits (the accepted drafts and one choice of the model's),
    before stop checks; records the drafts, the next forward's mask-slot drafts, and adapts
    the draft limit (draft_policy.py; `break_even`: a drafting forward's cost in AR ones)."""
    seq = plan.seq
    k = plan.drafts
    drafted = plan.tokens[plan.keep : plan.keep + k]
    choices = tokens[: k + 1]
    matches = drafted == choices[:k]
    n = int(np.argmin(matches)) if not matches.all() else k
    seq.drafted += k
    seq.accepted += n
    seq.draft_forwards += plan.width > plan.keep and not plan.opens  # a prompt's: free
    masks = plan.head_slots.size - k - 1
    if n == k and masks > 1:
        # Mask slot 0 sits where the committed choice goes; slots 1.. are guesses for the
        # positions after it. Keep the leading run that selection found confident.
        confident = fills[k + 2 : k + 1 + masks]
        run = int(np.argmin(confident)) if not confident.all() else confident.size
        seq.drafts = np.asarray(tokens[k + 2 : k + 2 + run], dtype=np.int32)
    else:
        seq.drafts = np.zeros(0, np.int32)
    committed = [int(t) for t in drafted[:n]] + [int(choices[n])]
    settle_shadow(seq, committed)  # a mask probe's guess, before this forward's own state
    if not plan.held:  # a forward its batch held back says nothing of its drafts
        adapt_draft_limit(seq, k, n, break_even, plan.width - plan.keep)
    return committed


def plan_next(
    seq: Sequence,
    mask_token_id: int,
    prefill_chunk: int,
    max_positions: int,
    break_even: float = 1.0,
    room: int | None = None,
) -> RowPlan:
    """`room`: a speculative row's drafts as its batch decided (plan_speculative)."""
    if seq.phase in (Phase.WAITING, Phase.PREFILL):
        return plan_prefill(seq, prefill_chunk, mask_token_id, max_positions, break_even)
    if seq.params.mode == Mode.WEDLM:
        return plan_wedlm(seq, mask_token_id)
    if seq.params.mode == Mode.SPECULATIVE:
        source = seq.params.draft
        return plan_speculative(seq, mask_token_id, max_positions, source, break_even, room)
    return plan_autoregressive(seq)


def apply_result(
    plan: RowPlan, fills: np.ndarray, tokens: np.ndarray, break_even: float = 1.0
) -> tuple[list[int], Phase]:
    """Postprocess one sequence after its forward: the tokens it committed, and the phase
    it is in now (the scheduler sets it). `break_even`: what a drafting forward costs in
    AR forwards, for speculative rows (draft_policy.py)."""
    seq = plan.seq
    seq.kv_length += plan.keep
    before = len(seq.output)
    decoding = seq.phase is Phase.DECODE
    if not decoding:
        seq.prefilled += plan.keep
        if seq.prefilled < len(seq.prefill_tokens()):
            return [], Phase.PREFILL
        if seq.rebuild_to:  # history rebuilt: decoding resumes where it stopped
            seq.rebuild_to = 0
            return [], Phase.DECODE
        if seq.params.mode == Mode.WEDLM:  # prefill logits are discarded
            w = seq.params.window
            seq.window_tokens = np.zeros(w, dtype=np.int32)
            seq.window_filled = np.zeros(w, dtype=bool)
            if not plan.opens:
                return [], Phase.DECODE
    seq.forwards += 1
    if seq.params.mode == Mode.WEDLM:
        end = seq.commit(plan.commits)
        window = plan.width - plan.head_slots.size  # where the window starts: p, or the chunk
        seq.window_tokens = np.where(fills, tokens, plan.tokens[window:]).astype(np.int32)
        seq.window_filled = plan.filled[window:] | fills
    elif seq.params.mode == Mode.SPECULATIVE and (decoding or plan.opens):
        end = seq.commit(accept_speculative(plan, fills, tokens, break_even))
    else:
        end = seq.commit([int(tokens[0])])
    return seq.output[before:], end or Phase.DECODE


# The two predicates below read a plan and the draft policy: here, not in draft_policy.py
# (which row_plan imports), so the two modules import each other in one direction only.
def unchanged_by_postprocess(plan: RowPlan, break_even: float = 1.0) -> bool:
    """Whether a speculative row, read back but not yet postprocessed, ran one row (no
    drafts, no mask slots) that leaves its draft state as it was: drafts off, or held back
    by its batch. The next forward's decision (batch_rooms with ahead=1) is then known
    before the postprocess, and may be AR's look-ahead (engine._launch_ahead)."""
    seq = plan.seq
    if plan.width != 1:
        return False
    return plan.held or seq.draft_limit == 0 or not can_pay(seq, break_even)


def probe_ends(plan: RowPlan) -> bool:
    """Whether a speculative row, read back but not yet postprocessed, was a mask probe (one
    pending token, mask slots, drafts off): its postprocess commits one token and leaves
    drafts off, its next probe PROBE_EVERY or more forwards away, so its next forward is
    one row (engine._launch_ahead launches it before the postprocess)."""
    seq = plan.seq
    return (
        seq.params.draft == "mask"
        and seq.draft_limit == 0
        and plan.keep == 1
        and plan.drafts == 0
        and plan.width > 1
        and not plan.held
    )
