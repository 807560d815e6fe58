"""Committed tokens' logprobs (coordinator/engine/token_logprobs.py) in OpenAI's two
shapes: chat's `logprobs.content` entries and completions' parallel lists (with `echo`,
the prompt's tokens first)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from common.tokenizer import Tokenizer

FLOOR = -9999.0  # OpenAI's stand-in for an impossible token (JSON has no -inf)


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class LogprobText:
    """Token strings and bytes of one tokenizer, cached (every request asks for them)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._piece = lru_cache(maxsize=1 << 16)(self._uncached)
        self._tokenizer = tokenizer

    def _uncached(self, token: int) -> tuple[str, list[int]]:
        raw = self._tokenizer.token_bytes(token)
        # part of a multi-byte character reads as its escaped bytes, as OpenAI writes it
        return raw.decode("utf-8", errors="backslashreplace"), list(raw)

    def chat(self, entries: list) -> dict[str, Any]:
        """{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}"""
        content = []
        for e in entries:
            token, raw = self._piece(e.token)
            top = []
            for t, v in e.top:
                s, b = self._piece(t)
                top.append({"token": s, "logprob": _value(v), "bytes": b})
            content.append(
                {"token": token, "logprob": _value(e.logprob), "bytes": raw, "top_logprobs": top}
            )
        return {"content": content}

    def completion(self, entries: list, offset: int = 0) -> dict[str, Any]:
        """Completions' lists; `offset`: characters of the answer before these tokens."""
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            token = self._piece(e.token)[0]
            tokens.append(token)
            values.append(_value(e.logprob))
            tops.append({self._piece(t)[0]: _value(v) for t, v in e.top})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    def echoed(self, first: int, prompt: list, generated: list, answer_at: int) -> dict[str, Any]:
        """Completions' lists with `echo`: the prompt's tokens (`first` has no logprob, as
        OpenAI and vLLM answer it: null, and null alternatives), then the generated ones;
        `answer_at`: where the generated text starts (after the echoed prompt's text)."""
        head = self._piece(first)[0]
        found = self.completion(prompt, len(head))
        after = self.completion(generated, answer_at)
        return {
            "tokens": [head, *found["tokens"], *after["tokens"]],
            "token_logprobs": [None, *found["token_logprobs"], *after["token_logprobs"]],
            "top_logprobs": [None, *found["top_logprobs"], *after["top_logprobs"]],
            "text_offset": [0, *found["text_offset"], *after["text_offset"]],
        }
