"""What a forward's head slots become on the device: the head's logits, selection (which
mask slots fill: WeDLM windows, speculative mask drafts) and sampling (with which tokens),
left lazy for the engine's one host sync. Only what the batch needs is built: every op
here sits between two forwards on the device, so a greedy autoregressive batch pays for
the head and an argmax only."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import mlx.core as mx

from coordinator.engine import constrained, logit_bias, token_logprobs
from coordinator.engine.sampling import greedy_tokens, sample_tokens
from coordinator.engine.selection import eager_window_fills, window_fills
from coordinator.engine.tick_batch import TickBatch


def select(
    head: Callable[[mx.array], mx.array],
    batch: TickBatch,
    hidden: mx.array,
    grammars: constrained.Grammars | None,
    fill: Future[constrained.Masks] | None = None,
) -> tuple[mx.array, mx.array, token_logprobs.SlotLogprobs | None]:
    """Head on the needed rows, selection and sampling, and the logprobs of rows that ask.
    `fill`: the batch's grammar masks, being filled (grammar_fills.py); without it they are
    filled here."""
    rows = len(batch.plans)
    if not batch.wants_head:
        return mx.zeros((rows, 0), mx.bool_), mx.zeros((rows, 0), mx.int32), None
    logits = head(hidden[:rows])  # the pipeline returned the head slots only
    fills, tokens = choose(batch, logits, grammars, fill)
    return fills, tokens, token_logprobs.slot_logprobs(batch.plans, logits, tokens)


def choose(
    batch: TickBatch,
    logits: mx.array,
    grammars: constrained.Grammars | None,
    fill: Future[constrained.Masks] | None = None,
) -> tuple[mx.array, mx.array]:
    """Selection (which slots fill) and sampling (with which tokens)."""
    if batch.any_selection or batch.any_sampling:
        logits = logits.astype(mx.float32)  # entropy and sampling work in float32
    is_mask = mx.array(batch.head_is_mask)
    if batch.any_selection:
        chosen = batch.selection_arrays()
        # compiled for WeDLM batches, whose head slots are W per row every step; a
        # speculative batch's vary with its drafts, and each new shape costs a trace
        pick = eager_window_fills if batch.any_speculative else window_fills
        fills = pick(
            logits, is_mask, chosen["threshold"], chosen["penalty"], batch.selection_offsets()
        )
    else:  # AR rows fill their one slot (an infinite threshold): exactly is_mask
        fills = is_mask
    # after selection, which reads the raw logits' entropies
    logits = logit_bias.adjust_logits(batch.plans, logits)
    if fill is not None:  # the last thing before sampling: the fill had the longest
        logits = constrained.apply_masks(fill.result(), logits)
    elif grammars is not None:
        logits = constrained.mask_logits(batch.plans, logits, grammars.executor)
    if not batch.any_sampling:
        return fills, greedy_tokens(logits)
    arrays = batch.sampling_arrays()
    tokens = sample_tokens(
        logits,
        arrays["temperature"],
        arrays["top_k"],
        arrays["top_p"],
        arrays["seed"],
        arrays["counter"],
        any_sampling=True,
        any_filter=batch.any_filter,
        strides=arrays["stride"] if batch.any_speculative else None,
        greedy_slots=batch.greedy_slots(),
    )
    return fills, tokens
