"""Token sampling on the device, vectorized over rows with per-row parameters.

Order as in the WeDLM reference: top-k, then top-p (both on the raw logits), then
temperature, then a categorical draw; temperature 0 means argmax. The draw is a Gumbel-max
over noise hashed from (request seed, step, slot, token id), so a request's samples do not
depend on which other requests share its batch. Speculative rows key their noise by the
output index each slot predicts (stride STEP_KEY per slot): a verified token then sees the
very noise autoregressive decoding would draw for that index, so with the same seed both
modes sample the same text, not only the same distribution.
"""

from __future__ import annotations

import mlx.core as mx

_M1, _M2 = 0x7FEB352D, 0x846CA68B
STEP_KEY = 0x9E3779B1  # the noise key of step (or output index) n is n * STEP_KEY + slot


def _hash(x: mx.array) -> mx.array:
    """A 32-bit integer mixer (lowbias32); uint32 arithmetic wraps on every backend."""
    x = x ^ (x >> 16)
    x = x * mx.array(_M1, mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(_M2, mx.uint32)
    return x ^ (x >> 16)


def gumbel_noise(
    seeds: mx.array, counters: mx.array, slots: int, vocab: int, strides: mx.array | None = None
) -> mx.array:
    """[N, slots, vocab] Gumbel(0, 1) noise for rows with these seeds and step counters;
    slot s of row n is keyed counters[n] * STEP_KEY + s * strides[n] (strides default 1)."""
    seeds = seeds.astype(mx.uint32)[:, None]
    counters = counters.astype(mx.uint32)[:, None]
    slot = mx.arange(slots, dtype=mx.uint32)[None, :]
    if strides is not None:
        slot = slot * strides.astype(mx.uint32)[:, None]
    base = _hash(_hash(seeds) ^ _hash(counters * STEP_KEY + slot))  # [N, slots]
    vocab_keys = _hash(mx.arange(vocab, dtype=mx.uint32) * 0x85EBCA77 + 0x27D4EB2F)
    bits = _hash(base[:, :, None] ^ vocab_keys[None, None, :])
    u = (bits >> 8).astype(mx.float32) * (1.0 / (1 << 24)) + (0.5 / (1 << 24))
    return -mx.log(-mx.log(u))


def _filter_top_k_top_p(logits: mx.array, top_k: mx.array, top_p: mx.array) -> mx.array:
    """Logits with tokens outside top-k, then outside the top-p nucleus, set to -inf."""
    vocab = logits.shape[-1]
    neg_inf = mx.array(-float("inf"), logits.dtype)
    order = mx.argsort(-logits, axis=-1)
    ranked = mx.take_along_axis(logits, order, axis=-1)
    k = mx.where(top_k > 0, mx.minimum(top_k, vocab), vocab).astype(mx.int32)
    kth = mx.take_along_axis(ranked, (k - 1)[..., None], axis=-1)
    ranked = mx.where(ranked >= kth, ranked, neg_inf)
    probs = mx.softmax(ranked, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    ranked = mx.where(before > top_p[..., None], neg_inf, ranked)
    # Scatter back to token order.
    return mx.put_along_axis(mx.full(logits.shape, neg_inf), order, ranked, axis=-1)


def greedy_tokens(logits: mx.array) -> mx.array:
    """The argmax token of every slot (exact in the logits' own dtype: upcasting a
    bfloat16 value is exact, so it cannot change which one is largest)."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def sample_tokens(
    logits: mx.array,
    temperature: mx.array,
    top_k: mx.array,
    top_p: mx.array,
    seeds: mx.array,
    counters: mx.array,
    *,
    any_sampling: bool,
    any_filter: bool,
    strides: mx.array | None = None,
    greedy_slots: mx.array | None = None,
) -> mx.array:
    """Tokens for logits [N, S, V] with per-row parameters [N]. The two flags are known on
    the host and keep greedy-only batches from paying for noise and sorting. `strides`:
    see gumbel_noise; `greedy_slots` [N, S]: slots that take the argmax whatever the
    temperature (speculative drafts from mask slots)."""
    greedy = greedy_tokens(logits)
    if not any_sampling:
        return greedy
    _, s, v = logits.shape
    temp = temperature[:, None]
    filtered = logits
    if any_filter:
        filtered = _filter_top_k_top_p(logits, top_k[:, None], top_p[:, None])
    safe_temp = mx.where(temp > 0, temp, 1.0)[..., None]
    scores = filtered / safe_temp + gumbel_noise(seeds, counters, s, v, strides)
    sampled = mx.argmax(scores, axis=-1).astype(mx.int32)
    use = temp > 0 if greedy_slots is None else (temp > 0) & ~greedy_slots
    return mx.where(use, sampled, greedy)
