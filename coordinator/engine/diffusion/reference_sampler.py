"""mlx-vlm's reference sampler (generate/diffusion.py, confidence-threshold), one step for
a batch of canvases. Every operation is per position or per canvas, so batching changes
nothing a canvas sees; each request draws from its own random stream in the reference's
order (a sample per step when sampling, then the random fill of unrevealed positions),
so a request seeded with s produces exactly what the reference produces after
`mx.random.seed(s)`."""

from __future__ import annotations

import mlx.core as mx

from common.diffusion.parts import DiffusionParts
from coordinator.engine.diffusion.canvas import Canvas, next_key, random_tokens
from coordinator.engine.diffusion.settings import DiffusionSettings
from coordinator.engine.diffusion.step_result import StepResult, canvas_arrays, padded_device


def token_entropy(logits: mx.array) -> mx.array:
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.sum(mx.exp(log_probs) * log_probs, axis=-1)


def soft_embeddings(parts: DiffusionParts, processed: mx.array) -> mx.array:
    """The self-conditioning signal the next forward embeds, as the reference computes it:
    softmax over the (temperature-scaled) logits, times the embedding table, scaled."""
    embed = parts.embed_tokens
    if not parts.prefers_logits_self_conditioning:
        return parts.conditioning(processed)
    # a quantized table: the reference keeps the logits and embeds them at the next step
    # (DecoderModel._embed_canvas): the same operations, done now
    probs = mx.softmax(processed, axis=-1, precise=True)
    soft = mx.quantized_matmul(
        probs.astype(parts.compute_dtype),
        embed.weight,
        embed.scales,
        embed.biases,
        transpose=False,
        group_size=embed.group_size,
        bits=embed.bits,
        mode=getattr(embed, "mode", "affine"),
    )
    return soft.astype(parts.compute_dtype) * parts.embed_scale


def reference_step(
    parts: DiffusionParts,
    settings: DiffusionSettings,
    canvases: list[Canvas],
    temperatures: list[float],
    threshold: float,
    logits: mx.array,
) -> StepResult:
    """`logits` [n, K, V]: the softcapped float32 logits of n canvases (K >= each length)."""
    _, width, vocab = logits.shape
    schedule = mx.array([settings.temperature(c.step, c.steps) for c in canvases], dtype=mx.float32)
    processed = logits / schedule[:, None, None]
    argmax = mx.argmax(processed, axis=-1).astype(mx.int32)
    denoiser, fills = [], []
    for i, (canvas, temp) in enumerate(zip(canvases, temperatures, strict=True)):
        row = argmax[i, : canvas.length]
        if canvas.step > 1:  # the last step only takes the argmax: no draws
            if temp > 0:
                canvas.key, draw = next_key(canvas.key)
                sample = mx.random.categorical(
                    processed[i : i + 1, : canvas.length] / temp, key=draw
                )
                row = sample[0].astype(mx.int32)
            fills.append(random_tokens(canvas, vocab))
        else:
            fills.append(mx.zeros((canvas.length,), mx.int32))
        denoiser.append(row)
    denoiser = padded_device(denoiser, width)
    fill = padded_device(fills, width).astype(mx.int32)
    revealed, draft = canvas_arrays(canvases, width)

    chosen = mx.take_along_axis(processed, denoiser[..., None], axis=-1)[..., 0]
    confidence = mx.exp(chosen - mx.logsumexp(processed, axis=-1))
    unrevealed = ~revealed
    accept = unrevealed & (confidence >= threshold)
    # no position clears the threshold: the most confident unrevealed one is taken
    needs_force = mx.any(unrevealed, axis=-1) & ~mx.any(accept, axis=-1)
    best = mx.argmax(mx.where(unrevealed, confidence, -mx.inf), axis=-1)
    forced = (mx.arange(width)[None, :] == best[:, None]) & needs_force[:, None]
    accept = accept | forced
    accepted = mx.where(accept, denoiser, draft)
    tokens = mx.where(revealed | accept, accepted, fill)
    entropy = None
    if settings.stability is not None:
        valid = mx.arange(width)[None, :] < mx.array([c.length for c in canvases])[:, None]
        per_token = mx.where(valid, token_entropy(processed), 0.0)
        entropy = per_token.sum(axis=-1) / valid.sum(axis=-1)
    return StepResult(
        rows=[],
        tokens=tokens,
        draft=mx.where(accept, accepted, draft),
        revealed=revealed | accept,
        argmax=argmax,
        conditioning=soft_embeddings(parts, processed),
        entropy=entropy,
    )
