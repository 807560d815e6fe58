"""OpenAI's harmony format (gpt-oss): an answer is messages, each a header, `<|message|>`,
a body and an end (`<|end|>`, `<|call|>` for a tool call, `<|return|>` for the last). The
header names the channel (analysis: reasoning; final: the answer; commentary: preambles,
and tool calls when it names a recipient `to=functions.NAME`). mlx-lm has no harmony
parser and the `openai-harmony` package is not installed here: this is a small one, for
text (the control tokens kept in it). `HarmonyStream` splits a streamed answer into
("reasoning" | "content", text) and ("call", name, arguments JSON) events; an answer
that is not harmony at all (a model that ignores the format) stays content."""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_START = "<|channel|>commentary to=functions."
_MESSAGE = "<|message|>"
_START = "<|start|>"
# What ends a body; <|start|> too, when a model skips the end.
_ENDS = ("<|end|>", "<|call|>", "<|return|>", _START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_HEADER_OPENERS = ("<|channel|>", " to=", "to=")
_LONGEST_HEADER = 256  # characters; longer without <|message|>: not harmony

Event = tuple[str, str] | tuple[str, str, str]


def header_fields(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of one message's header, e.g. ("commentary",
    "functions.get_weather"); a missing channel reads as final."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return (channel.group(1) if channel else "final"), (recipient.group(1) if recipient else None)


def call_arguments(body: str) -> dict[str, Any]:
    """A call's body: a JSON object (empty: no arguments); ValueError otherwise."""
    arguments = json.loads(body) if body.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError("harmony call arguments are not a JSON object")
    return arguments


def parse_tool_call(text: str, tools: Any = None) -> dict[str, Any]:
    """One call message, header through body (`<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>{...}`) → {"name", "arguments"}, as mlx-lm's parsers
    answer; ValueError when it is not one."""
    header, sep, body = text.partition(_MESSAGE)
    _, recipient = header_fields(header)
    if not sep or recipient is None or not recipient.startswith("functions."):
        raise ValueError("not a harmony function call")
    for end in _ENDS:
        body = body.removesuffix(end)
    return {"name": recipient.removeprefix("functions."), "arguments": call_arguments(body)}


class HarmonyStream:
    """`add(text)` / `finish()` return events in order. Tool calls come whole, at their
    end; reasoning and content as they arrive (a possible end marker held back)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "header"  # header | body | plain
        self.channel, self.recipient = "final", None
        self.body = ""  # a tool call's arguments so far

    def add(self, text: str) -> list[Event]:
        self.buffer += text
        out: list[Event] = []
        while self.buffer:
            if self.state == "plain":
                out.append(("content", self.buffer))
                self.buffer = ""
            elif self.state == "header":
                if not self._header(out):
                    break
            elif not self._body(out):
                break
        return out

    def _header(self, out: list[Event]) -> bool:
        """Reads a header up to <|message|>; False when it needs more text."""
        head = self.buffer
        if _START.startswith(head):
            return False
        head = head.removeprefix(_START)
        if "assistant".startswith(head):
            return False
        head = head.removeprefix("assistant")
        cut = head.find(_MESSAGE)
        if cut >= 0:
            self.channel, self.recipient = header_fields(head[:cut])
            self.buffer, self.state, self.body = head[cut + len(_MESSAGE) :], "body", ""
            return True
        opened = any(head.startswith(o) or o.startswith(head) for o in _HEADER_OPENERS)
        if not opened or len(head) > _LONGEST_HEADER:
            self.state = "plain"  # not harmony: the rest is the answer's text
            return True
        return False

    def _body(self, out: list[Event]) -> bool:
        """Sends a body's text up to its end; False when it needs more text."""
        cuts = [(self.buffer.find(e), e) for e in _ENDS if e in self.buffer]
        if cuts:
            cut, end = min(cuts)
            self._emit(out, self.buffer[:cut])
            self._close(out)
            self.buffer = self.buffer[cut + (0 if end == _START else len(end)) :]
            self.state = "header"
            return True
        keep = max((_overlap(self.buffer, e) for e in _ENDS), default=0)
        self._emit(out, self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def _emit(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if self._calling():
            self.body += text
        else:
            out.append(("reasoning" if self.channel == "analysis" else "content", text))

    def _calling(self) -> bool:
        return self.recipient is not None and self.recipient.startswith("functions.")

    def _close(self, out: list[Event]) -> None:
        if self._calling():
            out.append(("call", self.recipient.removeprefix("functions."), self.body))  # type: ignore[union-attr]
        self.recipient, self.body = None, ""

    def finish(self) -> list[Event]:
        """What was held back: a call cut short (the answer hit its limit, or `<|call|>`
        was its stop token) is sent as a call; a header that never opened a body, as
        content."""
        out: list[Event] = []
        if self.state == "body":
            self._emit(out, self.buffer)
            self._close(out)
        elif self.buffer:
            out.append(("content", self.buffer))
        self.buffer, self.state = "", "header"
        return out


def _overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
