"""Grammar-constrained decoding (structured output) with llguidance.

A request's params.grammar is an llguidance grammar (from a JSON schema, a Lark grammar or
a regex: coordinator/http_api/response_format.py). Its sequence gets a matcher when
submitted; before a forward's tokens are chosen, the matcher's allowed-token bitmask (32
tokens per int32, filled on the host) goes to the device, where it is expanded and added to
the row's logits as -inf for forbidden tokens; the tokens committed after the forward are
fed back to the matcher.

Decoding mode: a constrained request decodes autoregressively (one grammar-checked token
per forward) whatever mode it asks for. WeDLM and speculative forwards choose several
tokens from one forward's logits, where every slot after the first would need the mask of
a prefix not yet known; AR keeps the output exact at no risk. The answer's usage says
mode "ar"."""

from __future__ import annotations

import threading
from dataclasses import replace

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from common.errors import InvalidRequest
from common.generation_params import GenerationParams
from common.tokenizer import Tokenizer
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Sequence


class Grammars:
    """The llguidance view of one tokenizer (built once, on first use: about a second for
    a large vocabulary) and the matchers made with it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
        self._tokenizer, self.vocab_size, self._stop_ids = tokenizer, vocab_size, stop_ids
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(
                    self._tokenizer.hf_tokenizer,
                    n_vocab=self.vocab_size,
                    eos_token=list(self._stop_ids) or None,
                )
            return self._ll

    def check(self, grammar: str) -> None:
        """InvalidRequest with llguidance's words when the grammar cannot be used."""
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if problem:
            raise InvalidRequest(f"the grammar is not valid: {problem}")

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the grammar is not valid: {matcher.get_error()}")
        return matcher


def sequential_params(params: GenerationParams) -> GenerationParams:
    """A constrained or penalized request decodes autoregressively: its logits depend on
    every token before the choice (module docstring; logit_bias.py)."""
    if (params.grammar is None and not params.penalized) or params.mode == "ar":
        return params
    return replace(params, mode="ar", draft="auto")


def mask_logits(plans: list[RowPlan], logits: mx.array) -> mx.array:
    """Logits [N, K, V] with every constrained row's forbidden tokens at -inf (its
    matcher's state after everything committed so far)."""
    rows = [i for i, p in enumerate(plans) if p.seq.matcher is not None]
    if not rows:
        return logits
    n, _, v = logits.shape
    bitmask = llguidance.numpy.allocate_token_bitmask(n, v)
    bitmask[:] = -1  # rows without a grammar allow everything
    for i in rows:
        matcher = plans[i].seq.matcher
        if not matcher.is_error():
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, i)
    words = mx.array(bitmask.view(np.uint32))
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(n, -1)[:, :v].astype(mx.bool_)
    return mx.where(allowed[:, None, :], logits, mx.array(-float("inf"), logits.dtype))


def advance(plans: list[RowPlan], before: list[int]) -> None:
    """Feed each constrained sequence's newly committed tokens to its matcher."""
    for plan, start in zip(plans, before, strict=True):
        seq: Sequence = plan.seq
        new = seq.output[start:]
        if seq.matcher is not None and new and not seq.finished:
            seq.matcher.consume_tokens(new)
