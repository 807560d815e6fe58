"""The turbo sampler (the seed's techniques), one step for a batch of canvases:

- exact hierarchical top-K on the raw logits; softcap, temperature, softmax and the
  confidence run on the K candidates only (both maps are monotonic: the top K is the same
  before and after them);
- self-conditioning from the top candidates' embedding rows (a gather, no
  full-vocabulary matmul, no dequantized table);
- a two-stage confidence schedule (picky while the canvas takes shape, then relaxed) that
  never force-commits a whole canvas at the last step: one most-confident position per
  step is the only forced progress;
- EOS tail-drop: once a revealed position holds a stop token, the positions after it stop
  being denoised (they are revealed as they are; the commit ends at the stop token).
The repair pass (one more forward of the drained canvas, whose argmax commits) and the
repeat guard live in the scheduler (diffusion/scheduler.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.diffusion.parts import DiffusionParts
from coordinator.engine.diffusion.canvas import Canvas, next_key, random_tokens
from coordinator.engine.diffusion.settings import DiffusionSettings
from coordinator.engine.diffusion.step_result import StepResult, canvas_arrays, padded_device
from coordinator.engine.diffusion.topk import hierarchical_topk


def topk_conditioning(parts: DiffusionParts, probs: mx.array, ids: mx.array, k: int) -> mx.array:
    """[n, K, H]: the probability-weighted sum of the top-k candidates' embedding rows."""
    p = probs[..., :k]
    p = p / p.sum(axis=-1, keepdims=True)
    rows = parts.embed_tokens(ids[..., :k])  # [n, K, k, H], dequantized rows only
    soft = (p[..., None].astype(rows.dtype) * rows).sum(axis=-2)
    return soft * parts.embed_scale


def _scatter(base: mx.array, at: mx.array, values: mx.array) -> mx.array:
    """base [n, W, ...] with values [n, S, ...] written at positions at [n, S] (duplicate
    positions carry identical values)."""
    idx = at.reshape(*at.shape, *([1] * (values.ndim - 2)))
    return mx.put_along_axis(base, mx.broadcast_to(idx, values.shape), values, axis=1)


def turbo_step(
    parts: DiffusionParts,
    settings: DiffusionSettings,
    canvases: list[Canvas],
    stop_ids: tuple[int, ...],
    raw_logits: mx.array,
    repair: list[bool],
    slots: list[np.ndarray],
    temperatures: list[float] | None = None,
) -> StepResult:
    """`raw_logits` [n, S, V]: the head's logits before the softcap, of the canvas
    positions `slots[i]` of canvas i (all of them, or a compacted forward's live ones).
    Rows in `repair` are drained canvases re-read once: only their argmax matters. A row
    with a temperature samples its proposals among its top K (its own random stream), as
    the reference samples among the whole vocabulary; the argmax still commits."""
    opts = settings.turbo
    width = max(c.length for c in canvases)
    vocab = raw_logits.shape[-1]
    vals, ids = hierarchical_topk(raw_logits, opts.top_k, opts.chunk)
    ids = ids.astype(mx.int32)
    schedule = mx.array(
        [settings.temperature(max(c.step, 1), c.steps) for c in canvases], dtype=mx.float32
    )
    vals = parts.softcap(vals) / schedule[:, None, None]
    probs = mx.softmax(vals, axis=-1, precise=True)
    conditioning = topk_conditioning(parts, probs, ids, opts.conditioning_k)  # [n, S, H]
    # back to canvas positions (a forwarded slot list is padded with its first position)
    s = raw_logits.shape[1]
    at = mx.array(
        np.stack([np.concatenate([p, np.full(s - p.size, p[0])]) for p in slots]),
        dtype=mx.int32,
    )
    revealed, draft = canvas_arrays(canvases, width)
    pick, chosen_p = ids[..., 0], probs[..., 0]
    temperatures = temperatures or [0.0] * len(canvases)
    if any(t > 0 for t in temperatures):
        picks = []
        for i, (c, t, r) in enumerate(zip(canvases, temperatures, repair, strict=True)):
            if t > 0 and not r:
                c.key, draw = next_key(c.key)
                picks.append(mx.random.categorical(vals[i] / t, key=draw))
            else:
                picks.append(mx.zeros(vals.shape[1], mx.uint32))
        j = mx.stack(picks)[..., None]
        pick = mx.take_along_axis(ids, j, axis=-1)[..., 0]
        chosen_p = mx.take_along_axis(probs, j, axis=-1)[..., 0]
    argmax = _scatter(draft, at, ids[..., 0])
    proposal = _scatter(draft, at, pick)
    confidence = _scatter(mx.zeros(draft.shape, mx.float32), at, chosen_p)
    previous = [
        c.conditioning
        if c.conditioning is not None
        else mx.zeros((c.length, conditioning.shape[-1]), conditioning.dtype)
        for c in canvases
    ]
    previous = mx.stack([mx.pad(p, [(0, width - p.shape[0]), (0, 0)]) for p in previous]).astype(
        conditioning.dtype
    )
    conditioning = _scatter(previous, at, conditioning)
    hi, lo = opts.thresholds
    threshold = mx.array(
        [hi if c.taken < opts.relax_after else lo for c in canvases], dtype=mx.float32
    )
    unrevealed = ~revealed
    accept = unrevealed & (confidence >= threshold[:, None])
    needs_force = mx.any(unrevealed, axis=-1) & ~mx.any(accept, axis=-1)
    best = mx.argmax(mx.where(unrevealed, confidence, -mx.inf), axis=-1)
    positions = mx.arange(width)[None, :]
    accept = accept | ((positions == best[:, None]) & needs_force[:, None])
    draft = mx.where(accept, proposal, draft)
    revealed = revealed | accept
    if opts.eos_tail_drop and stop_ids:
        is_stop = mx.zeros(draft.shape, mx.bool_)
        for sid in stop_ids:
            is_stop = is_stop | (draft == sid)
        first = mx.argmax(revealed & is_stop, axis=-1)  # 0 when there is none
        any_stop = mx.any(revealed & is_stop, axis=-1)
        revealed = revealed | ((positions > first[:, None]) & any_stop[:, None])
    fill = padded_device(
        [
            mx.zeros((c.length,), mx.int32) if r else random_tokens(c, vocab)
            for c, r in zip(canvases, repair, strict=True)
        ],
        width,
    ).astype(mx.int32)
    return StepResult(
        rows=[],
        tokens=mx.where(revealed, draft, fill),
        draft=draft,
        revealed=revealed,
        argmax=argmax,
        conditioning=conditioning,
    )
