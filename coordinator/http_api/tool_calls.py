"""The model's tool-call text → OpenAI `tool_calls`. The markers and the parser are
mlx-lm's, chosen from the checkpoint's chat template (`Tokenizer.tool_calling`): e.g.
Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A whole answer is split
at once (`split_tool_calls`); a streamed one chunk by chunk (`ToolCallStream`), holding
back text that may begin a call until it is known, and sending each call once its end
marker arrives. Text that does not parse as a call stays text: nothing is dropped."""

from __future__ import annotations

import json
import uuid
from typing import Any

from common.tokenizer import ToolSyntax


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls(syntax: ToolSyntax, body: str, tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI tool calls (without index) from one call's text, or None when it does not
    parse."""
    try:
        parsed = syntax.parse(body, tools)
    except Exception:  # each parser raises its own kinds for a malformed call
        return None
    out = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"id": call.get("id") or call_id(), "type": "function",
                    "function": {"name": call["name"], "arguments": arguments}})  # fmt: skip
    return out


def split_tool_calls(
    syntax: ToolSyntax, text: str, tools: Any = None
) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the calls, the calls) of a whole answer."""
    stream = ToolCallStream(syntax, tools)
    pieces = [*stream.add(text), *stream.finish()]
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [c for p in pieces if isinstance(p, list) for c in p]
    return content, calls


class ToolCallStream:
    """`add(text)` / `finish()` return pieces in order: a str is text to send, a list is
    the OpenAI tool calls of one completed call."""

    def __init__(self, syntax: ToolSyntax, tools: Any = None) -> None:
        self.syntax = syntax
        self.tools = tools
        self.pending = ""  # text that may begin a call, or a call's text so far
        self.inside = False
        self.calls = 0

    def add(self, text: str) -> list[str | list[dict[str, Any]]]:
        out: list[str | list[dict[str, Any]]] = []
        self.pending += text
        start, end = self.syntax.start, self.syntax.end
        while self.pending:
            if self.inside:
                cut = self.pending.find(end)
                if cut < 0:
                    break
                body, self.pending = self.pending[:cut], self.pending[cut + len(end) :]
                self.inside = False
                out.append(self._call(body))
                continue
            cut = self.pending.find(start)
            if cut >= 0:
                if cut:
                    out.append(self.pending[:cut])
                self.pending = self.pending[cut + len(start) :]
                self.inside = True
                continue
            keep = _prefix_overlap(self.pending, start)
            sendable = self.pending[: len(self.pending) - keep]
            if sendable:
                out.append(sendable)
            self.pending = self.pending[len(sendable) :]
            break
        return [p for p in out if p]

    def _call(self, body: str) -> str | list[dict[str, Any]]:
        calls = _calls(self.syntax, body, self.tools)
        if calls is None:  # not a call after all: its text, markers included
            return self.syntax.start + body + self.syntax.end
        self.calls += len(calls)
        return calls

    def finish(self) -> list[str | list[dict[str, Any]]]:
        """What was held back: an unterminated call (the answer hit its limit) is parsed
        if it can be, else sent as text."""
        pending, self.pending = self.pending, ""
        if not self.inside:
            return [pending] if pending else []
        self.inside = False
        calls = _calls(self.syntax, pending, self.tools)
        if calls is None:
            return [self.syntax.start + pending]
        self.calls += len(calls)
        return [calls]


def _prefix_overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
