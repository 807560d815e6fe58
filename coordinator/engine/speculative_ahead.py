"""Speculative mode's look-ahead: the next verifying forward built on the device from this
step's choices, so it is launched before the host reads this step back (as WeDLM's
look-ahead does, wedlm_ahead.py, and AR's, engine._launch_ahead).

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

import mlx.core as mx
import numpy as np

from common.modes import Mode
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Phase


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
