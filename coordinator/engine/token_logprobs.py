"""Logprobs of committed tokens, computed on the device with the forward's selection and
read back in its one host sync, only for the rows whose request asks (params.logprobs).

What a token's logprob is: log-softmax of the raw logits (before temperature, top-k/top-p,
penalties or a grammar's mask, as vLLM reports them by default) of the forward that chose
the token, at the slot that chose it:
- autoregressive mode: the forward fed the previous token (one token per forward);
- speculative mode: the verifying forward; an accepted draft equals the model's own choice
  at its slot, so its logprob is that choice's, as autoregressive decoding would report;
- WeDLM mode: the forward that filled the mask slot (a token is chosen in one forward and
  committed, its KV made permanent, by a later one; the choosing forward's distribution
  is the one the token was drawn from).
A token is recorded by output index when chosen and handed out when it commits.

A prompt token's logprob (params.prompt_logprobs, completions' echo) is the same
log-softmax at the prefill row before it, computed on the scored rows of each prompt
chunk in that forward's sync (the head runs on them apart from the head slots)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from common.modes import Mode
from coordinator.engine.forward_shapes import row_bucket
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.scheduler import Commit


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k likeliest tokens and their logprobs


@dataclass
class SlotLogprobs:
    """Device arrays for the rows that ask (lazy until the step's sync)."""

    rows: list[int]  # batch rows, in the order of the arrays' first axis
    chosen: mx.array  # [R, K] logprob of each slot's chosen token
    top_ids: mx.array  # [R, K, k]
    top_values: mx.array  # [R, K, k]

    def arrays(self) -> list[mx.array]:
        return [self.chosen, self.top_ids, self.top_values]


class PromptLogprob(TokenLogprob):
    """A prompt token's logprob (params.prompt_logprobs): from the prefill row before it.
    They ride the sequence's first commit ahead of its tokens' own (attach), so the APIs
    tell them apart by this type."""


@dataclass
class PromptScores:
    """The scored prompt rows of the rows that ask (lazy until the step's sync)."""

    rows: list[int]  # batch rows, in the order of the arrays' first axis
    chosen: mx.array  # [R, S] logprob of the prompt's next token at each scored row
    top_ids: mx.array  # [R, S, k]
    top_values: mx.array  # [R, S, k]

    def arrays(self) -> list[mx.array]:
        return [self.chosen, self.top_ids, self.top_values]


def _top(logp: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest of the last axis, ordered by value (a full sort of V would cost more)."""
    if k == 0:
        empty = mx.zeros((*logp.shape[:-1], 0))
        return empty.astype(mx.int32), empty
    ids = mx.argpartition(-logp, kth=k - 1, axis=-1)[..., :k]
    values = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    return ids.astype(mx.int32), mx.take_along_axis(values, order, axis=-1)


def prompt_scores(
    plans: list[RowPlan], score_slots: np.ndarray, hidden: mx.array, head
) -> PromptScores | None:
    """For the scored rows' final hidden states [N, S, D] (the pipeline returns them after
    the head slots) and the model's `head`: the logprob of each next prompt token and the
    likeliest alternatives, for the rows that score any. The head runs on those rows only,
    their count padded to a bucket (bounded shapes; the padding repeats a row, never read)."""
    rows = [i for i, p in enumerate(plans) if p.score_slots.size]
    if not rows:
        return None
    width = score_slots.shape[1]
    targets = np.zeros((len(rows), width), dtype=np.int32)
    for r, i in enumerate(rows):
        p = plans[i]
        n = p.score_slots.size
        targets[r, :n] = p.seq.prompt[p.score_start : p.score_start + n]
    padded = rows + [rows[0]] * (row_bucket(len(rows)) - len(rows))
    raw = head(hidden[mx.array(padded)]).astype(mx.float32)[: len(rows)]
    # [R, S, V] is a chunk's rows times the vocabulary: no second array of that size
    # (log-softmax), the normalizer is subtracted from what is taken
    lse = mx.logsumexp(raw, axis=-1)
    chosen = mx.take_along_axis(raw, mx.array(targets)[..., None], axis=-1)[..., 0] - lse
    ids, values = _top(raw, max(plans[i].seq.params.logprobs or 0 for i in rows))
    return PromptScores(rows, chosen, ids, values - lse[..., None])


def record_prompt(found: PromptScores, plans: list[RowPlan]) -> None:
    """After the sync: store each scored prompt token's logprob by prompt index."""
    chosen, top_ids, top_values = (np.array(a).tolist() for a in found.arrays())
    for r, i in enumerate(found.rows):
        plan, seq = plans[i], plans[i].seq
        if seq.prompt_logprobs is None:  # handed out already (not expected: a re-prefill)
            continue
        k = seq.params.logprobs or 0
        for j in range(plan.score_slots.size):
            n = plan.score_start + j
            top = tuple(zip(top_ids[r][j][:k], top_values[r][j][:k], strict=True))
            seq.prompt_logprobs[n] = PromptLogprob(seq.prompt[n], chosen[r][j], top)


def asking_rows(plans: list[RowPlan]) -> list[int]:
    return [i for i, p in enumerate(plans) if p.seq.params.logprobs is not None]


def slot_logprobs(plans: list[RowPlan], logits: mx.array, tokens: mx.array) -> SlotLogprobs | None:
    """For logits [N, K, V] and the chosen tokens [N, K]: what the asking rows need."""
    rows = asking_rows(plans)
    if not rows or logits.shape[1] == 0:
        return None
    index = mx.array(rows)
    raw = logits[index].astype(mx.float32)
    logp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, tokens[index][..., None], axis=-1)[..., 0]
    ids, values = _top(logp, max(plans[i].seq.params.logprobs or 0 for i in rows))
    return SlotLogprobs(rows, chosen, ids, values)


def record(
    found: SlotLogprobs,
    plans: list[RowPlan],
    before: list[int],
    tokens: np.ndarray,
    fills: np.ndarray,
    was_wedlm_decode: list[bool],
) -> None:
    """After postprocess: store each chosen token's logprob by output index on its sequence.
    `before`: each row's output length before this forward's commit."""
    chosen, top_ids, top_values = (np.array(a).tolist() for a in found.arrays())
    for r, i in enumerate(found.rows):
        plan, seq = plans[i], plans[i].seq
        k = seq.params.logprobs or 0
        if was_wedlm_decode[i]:
            # head slot j is window slot j after this commit: output index before + p + j
            start = before[i] + len(plan.commits)
            slots = [j for j in range(plan.head_slots.size) if fills[i, j]]
        else:  # AR, speculative, a prefill's last row: slot j chose output index before + j
            start = before[i]
            slots = list(range(len(seq.output) - before[i]))
        for j in slots:
            top = tuple(zip(top_ids[r][j][:k], top_values[r][j][:k], strict=True))
            seq.token_logprobs[start + j] = TokenLogprob(int(tokens[i, j]), chosen[r][j], top)


def wedlm_decoding(plans: list[RowPlan]) -> list[bool]:
    """Per row, whether its forward is a WeDLM window step (read before postprocess): a
    decode row's, or the first window riding the prompt's last chunk (plan_opening)."""
    return [p.seq.params.mode == Mode.WEDLM and p.decodes for p in plans]


def attach(commits: list[Commit]) -> None:
    """Give each commit of an asking sequence the logprobs of its tokens (handed out: a
    token commits once)."""
    ends: dict[int, int] = {}  # a sequence may commit twice in one step (a look-ahead's)
    for commit in reversed(commits):
        seq = commit.seq
        if seq.params.logprobs is None or not commit.tokens:
            continue
        start = ends.get(seq.seq_id, len(seq.output)) - len(commit.tokens)
        ends[seq.seq_id] = start
        store = seq.token_logprobs
        commit.logprobs = [
            store.pop(n, None) or TokenLogprob(t, float("nan"), ())
            for n, t in enumerate(commit.tokens, start)
        ]
        if start == 0 and seq.params.prompt_logprobs and seq.prompt_logprobs is not None:
            # the first commit: the prompt's (index 1 on; the first token has none) first
            scored, seq.prompt_logprobs = seq.prompt_logprobs, None
            prompt = [
                scored.get(n) or PromptLogprob(seq.prompt[n], float("nan"), ())
                for n in range(1, len(seq.prompt))
            ]
            commit.logprobs = prompt + commit.logprobs
