"""Speculative (verified) decoding: drafts checked by one forward, AR's output exactly (the
rule: the block comment above plan_speculative).

Its look-ahead: the next verifying forward built on the device from this step's
choices, so it is launched before the host reads this step back (as WeDLM's look-ahead
does, wedlm.py, and AR's, ar.py).

A verifying forward of a row feeds its pending tokens (c), k drafts and m mask slots; the
device's choices at the last pending row and at each draft give the accepted run n (the
leading drafts equal to the choices) and the committed tokens, choices[0..n]. When every
draft was accepted, the confident leading run of the mask slots past the first (the
guesses for the positions after choices[k]) is the next forward's drafts. So the next
forward's row, from the position after the c pending ones, is: choices[0..n] (pending
then), the guesses if all were accepted, then mask slots up to a fixed width (the width
of this forward: n + 1 + guesses always fit in it). Exactly what row_plan.plan_speculative
makes from the same state, except for the count of trailing mask slots; the drafts are
verified whatever their number, so the output is AR's token for token. The row is causal
(filled slots, then masks); it goes to the layers as an explicit mask all the same, whose
KV spans are bucketed (the fused causal path takes the exact span, and on MLX-CUDA each new
key length builds an attention graph: RESULTS.md SC8).

Which rows become permanent KV (n + 1) and which rows' logits are needed are named once
the host has read this step back (`resolve`), while the forward runs. The draft policy
decides one forward late: a row whose drafts this step turns off drafts once more."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np

from common.generation_params import GenerationParams
from common.modes import Mode
from coordinator.engine.draft_policy import adapt_draft_limit, can_pay, draft_room, settle_shadow
from coordinator.engine.modes.base import (
    AheadForward,
    AheadRoom,
    DecodingMode,
    Flight,
    PlanContext,
    ahead_spec,
)
from coordinator.engine.prompt_lookup import prompt_lookup
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Phase, Sequence


class SpeculativeMode(DecodingMode):
    name = Mode.SPECULATIVE

    def uses_masks(self, params: GenerationParams) -> bool:
        return params.draft == "mask"

    def resolve(self, params: GenerationParams, has_drafter: bool, wedlm_trained: bool):
        """Draft source "auto" becomes the draft model when one is loaded, else mask slots
        on a WeDLM-trained checkpoint, else prompt lookup."""
        if params.draft != "auto":
            return params
        draft = "model" if has_drafter else "mask" if wedlm_trained else "lookup"
        return replace(params, draft=draft)

    def plan(self, seq: Sequence, ctx: PlanContext, room: int | None) -> RowPlan:
        source = seq.params.draft
        return plan_speculative(
            seq, ctx.mask_token_id, ctx.max_positions, source, ctx.break_even, room
        )

    def opening(
        self, seq: Sequence, chunk_tokens: np.ndarray, ctx: PlanContext
    ) -> RowPlan | None:
        """With mask drafts, the last prompt row chooses the first token as AR's does, and
        the mask slots after it draft the next ones (the chunk as the pending rows), so the
        first decode forward can verify drafts at once."""
        if seq.params.draft != "mask" or seq.draft_limit is not None:
            return None  # only a new request's first exploration (draft_policy.py)
        plan = plan_speculative(
            seq, ctx.mask_token_id, ctx.max_positions, "mask", ctx.break_even,
            pending=chunk_tokens,
        )  # fmt: skip
        if plan.width == plan.keep or plan.width > ctx.prefill_chunk:
            return None  # no mask slot (drafts cannot pay, or one token to go) or no room
        plan.opens = True
        return plan

    def commit(
        self, plan: RowPlan, fills: np.ndarray, tokens: np.ndarray, break_even: float
    ) -> list[int]:
        if plan.seq.phase is not Phase.DECODE and not plan.opens:
            return [int(tokens[0])]  # the prompt's last row chose the first token
        return accept_speculative(plan, fills, tokens, break_even)

    def drafting(self, plan: RowPlan) -> bool:
        return plan.seq.phase is Phase.DECODE

    def launch_ahead(
        self, room: AheadRoom, flight: Flight, fills: mx.array, tokens: mx.array
    ) -> AheadForward | None:
        """For a micro-batch of speculative rows in a drafting spell, the next verifying
        forward from this step's choices before reading them back. Only where every layer
        runs in this process, as WeDLM's."""
        if not room.speculative_ahead or not room.keeps_later or room.prefill(flight):
            return None
        live = [i for i, p in enumerate(flight.plans) if not p.seq.finished]
        plans = [flight.plans[i] for i in live]
        if not plans or not all(chains(p) for p in plans):
            return None
        if room.chain_breaks(flight, plans):
            return None
        if all(len(p.seq.output) + p.drafts + 1 >= p.seq.params.max_tokens for p in plans):
            return None  # every row may end at this step
        width = flight.batch.tokens.shape[1]
        if any(p.seq.kv_length + p.keep + width > room.ctx.max_positions for p in plans):
            return None
        padding = room.padding_ids(flight, len(plans))
        rows = mx.array(live)
        row_caps = caps(plans)
        ids = next_inputs(
            plans, fills[rows], tokens[rows], room.ctx.mask_token_id, width, len(padding),
            row_caps,
        )  # fmt: skip
        b = len(plans) + len(padding)
        # causal rows (module docstring), as an explicit mask: the fused causal path takes
        # the exact KV span, a key length new to MLX-CUDA's attention at every step (SC8)
        causal = mx.array(np.broadcast_to(np.tri(width, dtype=bool), (b, width, width)))
        spec = ahead_spec(plans, padding, width, np.ones((b, width), dtype=bool), causal)
        return AheadForward(plans, spec, ids, width=width, caps=row_caps)

    def resolve_ahead(self, stand_in: RowPlan, flight: Flight, row: int, ctx: PlanContext):
        return resolve(stand_in, flight.width, flight.caps[row], ctx.mask_token_id)


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




def with_model_drafts(plans: list[RowPlan], drafter, ctx: PlanContext) -> list[RowPlan]:
    """Rows drafting with the draft model (coordinator/engine/draft_model.py) get its
    proposals, then are planned again (their plans were made without drafts)."""
    rows = [  # a row its batch held back (draft_policy.batch_rooms) drafts nothing
        i for i, p in enumerate(plans)
        if p.seq.params.draft == "model" and p.seq.phase is Phase.DECODE and not p.held
    ]  # fmt: skip
    if not rows:
        return plans
    seqs = [plans[i].seq for i in rows]
    be = ctx.break_even
    counts = [min(draft_room(s, be), s.params.max_tokens - len(s.output) - 1) for s in seqs]
    drafter.propose(seqs, counts)
    plans = list(plans)
    for i, seq in zip(rows, seqs, strict=True):
        plans[i] = plan_speculative(seq, ctx.mask_token_id, ctx.max_positions, "model", be)
    return plans


def chains(plan: RowPlan) -> bool:
    """Whether a row's next forward may be built on the device: a speculative row with
    mask drafts in a drafting spell whose forward carried drafts or mask slots (not a
    probe: its drafts are off; no grammar: a cut run would change the next window)."""
    seq = plan.seq
    return (
        seq.phase is Phase.DECODE
        and seq.params.mode == Mode.SPECULATIVE
        and seq.params.draft == "mask"
        and seq.draft_limit != 0
        and seq.matcher is None
        and plan.width > plan.keep
        and not plan.held
    )


def caps(plans: list[RowPlan]) -> list[int]:
    """The most drafts each row's next forward carries: its draft limit as it stands (the
    policy's, one forward late), as plan_speculative would let it."""
    return [p.seq.params.window if p.seq.draft_limit is None else p.seq.draft_limit for p in plans]


def next_inputs(
    plans: list[RowPlan],
    fills: mx.array,
    tokens: mx.array,
    mask_token_id: int,
    width: int,
    pad_rows: int,
    draft_caps: list[int],
) -> mx.array:
    """[rows + pad_rows, width] input ids of the next forward, on the device (module
    docstring). `fills`/`tokens`: [rows, K] selection and choices at the head slots;
    `draft_caps`: at most that many guesses per row (caps)."""
    rows, k_slots = len(plans), tokens.shape[1]
    drafted = np.full((rows, k_slots), -1, np.int32)  # never a token: stops the match
    k = np.array([p.drafts for p in plans], np.int32)
    m = np.array([p.head_slots.size - p.drafts - 1 for p in plans], np.int32)
    for i, p in enumerate(plans):
        drafted[i, : p.drafts] = p.tokens[p.keep : p.keep + p.drafts]
    choices = tokens[:rows].astype(mx.int32)
    n = mx.cumprod((choices == mx.array(drafted)).astype(mx.int32), axis=1).sum(axis=1)
    k_dev, m_dev = mx.array(k)[:, None], mx.array(m)[:, None]
    j = mx.arange(k_slots)[None, :]
    guess_at = mx.clip(k_dev + 2 + j, 0, k_slots - 1)
    confident = mx.take_along_axis(fills[:rows], guess_at, axis=1) & (j < m_dev - 1)
    run = mx.cumprod(confident.astype(mx.int32), axis=1).sum(axis=1)
    run = mx.where(n == mx.array(k), mx.minimum(run, mx.array(draft_caps)), 0)[:, None]
    n = n[:, None]
    s = mx.arange(width)[None, :]
    chosen = mx.take_along_axis(choices, mx.clip(s, 0, k_slots - 1), axis=1)
    guessed = mx.take_along_axis(choices, mx.clip(k_dev + 1 + s - n, 0, k_slots - 1), axis=1)
    ids = mx.where(s <= n, chosen, mx.where(s <= n + run, guessed, mask_token_id))
    if pad_rows:
        ids = mx.concatenate([ids, mx.zeros((pad_rows, width), mx.int32)])
    return ids.astype(mx.int32)


def resolve(plan: RowPlan, width: int, cap: int, mask_token_id: int) -> RowPlan:
    """The next forward's plan for `plan`'s sequence, once this step is postprocessed:
    its pending tokens (choices[0..n]), its drafts (the guesses accept_speculative kept,
    up to `cap`) and mask slots up to `width`, as next_inputs built them on the device."""
    seq = plan.seq
    pending = np.asarray(seq.pending(), np.int32)
    drafts = np.asarray(seq.drafts[:cap], np.int32)
    c, k = pending.size, drafts.size
    m = width - c - k
    tokens = np.concatenate([pending, drafts, np.full(m, mask_token_id, np.int32)])
    return RowPlan(
        seq=seq,
        tokens=tokens,
        filled=np.arange(width) < c + k,
        keep=c,
        head_slots=np.arange(c - 1, width),
        head_is_mask=np.arange(width - c + 1) > k,
        drafts=k,
    )
