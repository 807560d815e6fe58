"""One choice's answer in the OpenAI shapes: its ids and object names, each streamed chunk
(text, reasoning, tool calls, usage) as server-sent-event text, and the whole reply."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from coordinator.engine.token_logprobs import PromptLogprob
from coordinator.http_api.logprobs_format import LogprobText


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class Echo:
    """What a completion with `echo` answers before its own text."""

    text: str  # the prompt as sent (token ids: decoded)
    first: int  # the prompt's first token (it has no logprob)
    drop: bool  # max_tokens 0: the one token decoded is not answered


class ChoiceReply:
    """The ids, object names and shapes of one request's answer (chat or text)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        index: int = 0,
        first: ChoiceReply | None = None,
        echo: Echo | None = None,
    ):
        """`index`: the choice (n > 1, several prompts); `first`: choice 0's reply, whose
        id it shares; `echo`: its prompt, answered first (completions' echo)."""
        self.chat = chat
        self.echo = echo
        self.id = first.id if first else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = first.created if first else int(time.time())
        self.index = index
        self.call_index = 0  # of the next streamed tool call
        self.text_offset = 0  # completions' logprobs: characters answered so far
        # A text chunk is this prefix, the JSON string, this suffix: built once per
        # request, since a stream sends one per commit.
        head = sse(self._envelope("chat.completion.chunk" if chat else "text_completion", []))
        head = head.removesuffix("]}\n\n")
        if chat:
            self._text_prefix = head + f'{{"index":{index},"delta":{{"content":'
            self._text_suffix = '},"finish_reason":null,"logprobs":null}]}\n\n'
        else:
            self._text_prefix = head + f'{{"index":{index},"text":'
            self._text_suffix = ',"finish_reason":null,"logprobs":null}]}\n\n'

    def _envelope(self, obj: str, choices: list, **extra) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}  # fmt: skip

    def text_chunk(self, text: str, logprobs: dict[str, Any] | None = None) -> str:
        if logprobs is None:
            return self._text_prefix + json.dumps(text) + self._text_suffix
        if self.chat:
            choice = {"index": self.index, "delta": {"content": text}, "finish_reason": None,
                      "logprobs": logprobs}  # fmt: skip
            return sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": self.index, "text": text, "finish_reason": None, "logprobs": logprobs}
        return sse(self._envelope("text_completion", [choice]))

    def logprobs(self, entries: list, text: LogprobText) -> dict[str, Any]:
        """Entries in this API's shape (completions count characters across chunks)."""
        if self.chat:
            return text.chat(entries)
        found = text.completion(entries, self.text_offset)
        if found["tokens"]:
            self.text_offset = found["text_offset"][-1] + len(found["tokens"][-1])
        return found

    def echoed(
        self,
        text: str,
        entries: list,
        leader: list,
        token_text: LogprobText,
        logprobs: bool,
        answer: bool = True,
    ) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt, then `text` (dropped when echo only), and with `logprobs`
        their tokens' (the prompt's from `leader`: its prompt's first choice's entries,
        the generated ones from `entries`; `answer` False: the prompt's only, a stream's
        first chunk). Later chunks' offsets continue after them."""
        echo = self.echo
        assert echo is not None
        keep = answer and not echo.drop
        whole = echo.text + (text if keep else "")
        self.text_offset = len(echo.text)
        if not logprobs:
            return whole, None
        prompt = [e for e in leader if isinstance(e, PromptLogprob)]
        own = [e for e in entries if not isinstance(e, PromptLogprob)] if keep else []
        found = token_text.echoed(echo.first, prompt, own, len(echo.text))
        if own:
            self.text_offset = found["text_offset"][-1] + len(found["tokens"][-1])
        return whole, found

    def commit_chunk(self, text: str, forwards: int, tokens: int) -> str:
        """A text chunk that also says how many forwards committed it (stream_commits)."""
        extra = f',"wedlm":{{"forwards":{forwards},"tokens":{tokens}}}}}\n\n'
        return self.text_chunk(text).removesuffix("}\n\n") + extra

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": self.index, "delta": delta, "finish_reason": finish,
                      "logprobs": None}  # fmt: skip
            return sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": self.index, "text": text or "", "finish_reason": finish,
                  "logprobs": None}  # fmt: skip
        return sse(self._envelope("text_completion", [choice]))

    def usage_chunk(self, usage: dict[str, int]) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(obj, [], usage=usage))

    def reasoning_chunk(self, text: str, logprobs: dict[str, Any] | None = None) -> str:
        """Reasoning text, under both names clients read (mlx-lm's and vLLM's
        `reasoning`, DeepSeek's `reasoning_content`)."""
        delta = {"reasoning": text, "reasoning_content": text}
        choice = {"index": self.index, "delta": delta, "finish_reason": None,
                  "logprobs": logprobs}  # fmt: skip
        return sse(self._envelope("chat.completion.chunk", [choice]))

    def calls_chunk(self, calls: list[dict[str, Any]]) -> str:
        """Tool calls, each whole in one delta (sent once its end marker arrived)."""
        deltas = []
        for call in calls:
            deltas.append({"index": self.call_index, **call})
            self.call_index += 1
        choice = {"index": self.index, "delta": {"tool_calls": deltas}, "finish_reason": None,
                  "logprobs": None}  # fmt: skip
        return sse(self._envelope("chat.completion.chunk", [choice]))

    def whole(
        self,
        text: str,
        finish: str,
        usage: dict[str, int],
        calls: list | None = None,
        logprobs: dict[str, Any] | None = None,
        reasoning: str = "",
    ) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
            if calls:
                message["content"] = text or None
                message["tool_calls"] = calls
            choice = {"index": self.index, "message": message, "finish_reason": finish,
                      "logprobs": logprobs}  # fmt: skip
            return self._envelope("chat.completion", [choice], usage=usage)
        choice = {"index": self.index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return self._envelope("text_completion", [choice], usage=usage)
