"""Per-row changes to the logits before a token is chosen, on the device:
- the repetition penalty (HF's, from CTRL): a token of the prompt or the output has its
  logit divided by r when positive, multiplied by r when negative;
- presence and frequency penalties (OpenAI's): minus presence for a token already in the
  output, minus frequency times its count there;
- logit_bias: a value added to a token's logit (-100 bans it, 100 all but forces it).
The host sends (row, token, value) triples for the rows that ask; they are scattered into
[rows, V] arrays on the device. Penalized requests decode autoregressively (constrained.
sequential_params): a penalty depends on every token before the choice, which a parallel
forward's later slots do not know; logit_bias alone does not, and applies in every mode.
Entropy-based selection (WeDLM) reads the raw logits; only the token choice is biased."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from coordinator.engine.row_plan import RowPlan


def adjust_logits(plans: list[RowPlan], logits: mx.array) -> mx.array:
    """Logits [N, K, V] with each asking row's penalties and biases applied."""
    rows = [i for i, p in enumerate(plans) if p.seq.params.logit_bias or p.seq.params.penalized]
    if not rows:
        return logits
    n, _, v = logits.shape
    add: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    scale: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for i in rows:
        seq = plans[i].seq
        params = seq.params
        if params.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(seq.prompt + seq.output, dtype=np.int64))
            seen = seen[seen < v]
            penalty = np.full(seen.size, params.repetition_penalty)
            scale.append((np.full(seen.size, i), seen, penalty))
        if params.presence_penalty or params.frequency_penalty:
            tokens, counts = np.unique(np.asarray(seq.output, dtype=np.int64), return_counts=True)
            keep = tokens < v
            value = params.presence_penalty + params.frequency_penalty * counts[keep]
            add.append((np.full(keep.sum(), i), tokens[keep], -value))
        if params.logit_bias:
            pairs = np.array([(t, b) for t, b in params.logit_bias if t < v]).reshape(-1, 2)
            add.append((np.full(len(pairs), i), pairs[:, 0], pairs[:, 1]))
    logits = logits.astype(mx.float32)
    if scale:
        r, t, f = (np.concatenate(parts) for parts in zip(*scale, strict=True))
        factor = mx.ones((n, v)).at[mx.array(r), mx.array(t)].add(mx.array(f - 1, mx.float32))
        factor = factor[:, None, :]
        logits = mx.where(logits > 0, logits / factor, logits * factor)
    if add:
        r, t, b = (np.concatenate(parts) for parts in zip(*add, strict=True))
        bias = mx.zeros((n, v)).at[mx.array(r), mx.array(t.astype(np.int64))].add(
            mx.array(b, mx.float32)
        )
        logits = logits + bias[:, None, :]
    return logits
