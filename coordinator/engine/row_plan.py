"""What one sequence contributes to the next forward: its rows, their visibility, how many
of them become permanent KV, and which rows' logits the coordinator needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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

    @property
    def width(self) -> int:
        return int(self.tokens.size)


_NONE = np.zeros(0, dtype=np.int64)


def plan_prefill(seq: Sequence, chunk: int) -> RowPlan:
    """The next chunk of the prompt (or of the history being rebuilt); AR needs the last
    prompt row's logits, a rebuild needs none."""
    start = seq.prefilled
    source = seq.prefill_tokens()
    tokens = np.asarray(source[start : start + chunk], dtype=np.int32)
    last = start + tokens.size == len(source)
    wants_head = last and seq.params.mode == "ar" and not seq.rebuild_to
    head = np.array([tokens.size - 1]) if wants_head else _NONE
    return RowPlan(
        seq=seq,
        tokens=tokens,
        filled=np.ones(tokens.size, dtype=bool),
        keep=int(tokens.size),
        head_slots=head,
        head_is_mask=np.ones(head.size, dtype=bool),
    )


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


def plan_next(seq: Sequence, mask_token_id: int, prefill_chunk: int) -> RowPlan:
    if seq.phase in (Phase.WAITING, Phase.PREFILL):
        return plan_prefill(seq, prefill_chunk)
    if seq.params.mode == "wedlm":
        return plan_wedlm(seq, mask_token_id)
    return plan_autoregressive(seq)


def apply_result(plan: RowPlan, fills: np.ndarray, tokens: np.ndarray) -> list[int]:
    """Postprocess one sequence after its forward; returns the tokens it committed."""
    seq = plan.seq
    seq.kv_length += plan.keep
    before = len(seq.output)
    if seq.phase in (Phase.WAITING, Phase.PREFILL):
        seq.prefilled += plan.keep
        seq.phase = Phase.PREFILL
        if seq.prefilled < len(seq.prefill_tokens()):
            return []
        seq.phase = Phase.DECODE
        if seq.rebuild_to:  # history rebuilt: decoding resumes where it stopped
            seq.rebuild_to = 0
            return []
        if seq.params.mode == "wedlm":  # prefill logits are discarded
            w = seq.params.window
            seq.window_tokens = np.zeros(w, dtype=np.int32)
            seq.window_filled = np.zeros(w, dtype=bool)
            return []
    seq.forwards += 1
    if seq.params.mode == "wedlm":
        seq.commit(plan.commits)
        p = plan.keep
        seq.window_tokens = np.where(fills, tokens, plan.tokens[p:]).astype(np.int32)
        seq.window_filled = plan.filled[p:] | fills
    else:
        seq.commit([int(tokens[0])])
    if seq.finish_reason:
        seq.phase = Phase.FINISHED
    return seq.output[before:]
