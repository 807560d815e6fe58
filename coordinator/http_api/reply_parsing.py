"""A chat answer → its parts, per the model's own format (`Tokenizer.reply`, read from
the checkpoint): the answer's text, its reasoning (`Reasoning` pieces) and its tool calls
(OpenAI `tool_calls` lists). Every HTTP API (chat completions, Messages, Ollama,
Responses) streams through one `ReplyStream` and words the pieces its own way.

- harmony (gpt-oss): channels, through common/harmony.py;
- reasoning markers (`<think>`…`</think>`, mlx-lm's think_start/think_end): mlx-lm's
  TextStateMachine splits them off, starting inside reasoning when the prompt opened it
  (GLM-4.7's template ends with `<think>`); a call may start inside reasoning, as
  mlx-lm's server allows;
- tool calls in the answer's text: mlx-lm's markers and parser (tool_calls.py).
A model with none of these answers plain text (the fallback); calls are parsed only when
the request gives tools."""

from __future__ import annotations

import json
from typing import Any

from common.harmony import HarmonyStream, call_arguments
from common.tokenizer import ReplySyntax, Tokenizer
from coordinator.http_api.tool_calls import ToolCallStream, call_id

Piece = str | list[dict[str, Any]]  # a str that is a Reasoning is reasoning text


class Reasoning(str):
    """Reasoning text (a piece of the answer's thinking, not its content)."""


class ReplyStream:
    """`add(text)` / `finish()` return pieces in order: a plain str is content, a
    `Reasoning` is reasoning, a list the OpenAI tool calls of one completed call.
    `tools`: the request's tools (None: calls are not parsed, their text stays text)."""

    def __init__(self, syntax: ReplySyntax, tools: list | None, in_reasoning: bool = False):
        self.syntax, self.tools = syntax, tools
        self.calls = 0
        self._harmony = HarmonyStream() if syntax.harmony else None
        calling = tools is not None and syntax.tools is not None and not syntax.harmony
        self._calls = ToolCallStream(syntax.tools, tools) if calling else None  # type: ignore[arg-type]
        self._machine = self._state = None
        if syntax.think is not None and not syntax.harmony:
            self._machine, self._state = _think_machine(syntax, calling, in_reasoning)
        self._entering_call = False  # the last segment was reasoning: a "call" begins one

    def add(self, text: str) -> list[Piece]:
        if self._harmony is not None:
            return self._from_harmony(self._harmony.add(text))
        if self._machine is None:
            return self._answer(text)
        from mlx_lm.generate import TextStateMachine

        self._state, segments = TextStateMachine.split(self._state, text)
        return self._segments(segments)

    def finish(self) -> list[Piece]:
        if self._harmony is not None:
            return self._from_harmony(self._harmony.finish())
        out: list[Piece] = []
        if self._machine is not None:
            from mlx_lm.generate import TextStateMachine

            self._state, rest, name = TextStateMachine.flush(self._state)
            out += self._segments([(name, rest)])
        if self._calls is not None:
            out += self._counted(self._calls.finish())
        return [p for p in out if p]

    def _segments(self, segments: list[tuple[str | None, str]]) -> list[Piece]:
        out: list[Piece] = []
        for name, text in segments:
            if name == "reasoning":
                out += [Reasoning(text)] if text else []
            elif name == "call" and self._entering_call:
                self._entering_call = False  # the marker the machine took: give it back
                out += self._answer(self.syntax.tools.start + text)  # type: ignore[union-attr]
            else:
                out += self._answer(text)
            self._entering_call = name == "reasoning"
        return [p for p in out if p]

    def _answer(self, text: str) -> list[Piece]:
        if self._calls is None:
            return [text] if text else []
        return self._counted(self._calls.add(text))

    def _counted(self, pieces: list) -> list[Piece]:
        self.calls = self._calls.calls if self._calls is not None else self.calls
        return pieces

    def _from_harmony(self, events: list) -> list[Piece]:
        out: list[Piece] = []
        for event in events:
            if event[0] == "reasoning":
                out.append(Reasoning(event[1]))
            elif event[0] == "content":
                out.append(event[1])
            elif self.tools is None:  # a call nobody offered: its arguments are text
                out.append(event[2])
            else:
                out.append(_harmony_call(event[1], event[2]))
        self.calls += sum(len(p) for p in out if isinstance(p, list))
        return out


def _harmony_call(name: str, body: str) -> Piece:
    try:
        arguments = call_arguments(body)
    except ValueError:
        return body  # not a call after all: its text
    arguments_text = json.dumps(arguments, ensure_ascii=False)
    return [{"id": call_id(), "type": "function",
             "function": {"name": name, "arguments": arguments_text}}]  # fmt: skip


def _think_machine(syntax: ReplySyntax, calling: bool, in_reasoning: bool):
    """mlx-lm's TextStateMachine: normal ⇄ reasoning at the think markers; "call" (an
    answer state) entered from reasoning at a tool call's start marker."""
    from mlx_lm.generate import TextStateMachine

    start, end = syntax.think  # type: ignore[misc]
    transitions: dict[str, list[tuple[str, str]]] = {
        "normal": [(start, "reasoning")],
        "reasoning": [(end, "normal")],
        "call": [(start, "reasoning")],
    }
    if calling:
        transitions["reasoning"].append((syntax.tools.start, "call"))  # type: ignore[union-attr]
    machine = TextStateMachine(transitions)
    return machine, machine.make_state("reasoning" if in_reasoning else "normal")


def split_reply(
    syntax: ReplySyntax, text: str, tools: list | None, in_reasoning: bool = False
) -> tuple[str, str, list[dict[str, Any]]]:
    """(content, reasoning, tool calls) of a whole answer."""
    stream = ReplyStream(syntax, tools, in_reasoning)
    pieces = [*stream.add(text), *stream.finish()]
    content = "".join(p for p in pieces if isinstance(p, str) and not isinstance(p, Reasoning))
    reasoning = "".join(p for p in pieces if isinstance(p, Reasoning))
    calls = [c for p in pieces if isinstance(p, list) for c in p]
    return content, reasoning, calls


def reply_stream(tokenizer: Tokenizer, tools: list | None, prompt: list[int]) -> ReplyStream | None:
    """The parser of one chat answer (None: plain text, nothing to parse). `tools`: the
    request's (chat_tools), None when it offers none; `prompt`: its ids (a template may
    open the reasoning)."""
    syntax = tokenizer.reply
    if tools is None and syntax.think is None and not syntax.harmony:
        return None
    return ReplyStream(syntax, tools, tokenizer.starts_in_reasoning(prompt))


def split_answer(
    tokenizer: Tokenizer, text: str, tools: list | None, prompt: list[int]
) -> tuple[str, str, list[dict[str, Any]]]:
    """(content, reasoning, tool calls) of a whole chat answer."""
    return split_reply(tokenizer.reply, text, tools, tokenizer.starts_in_reasoning(prompt))


def has_reasoning(tokenizer: Tokenizer) -> bool:
    """The model writes its reasoning apart from its answer (think markers, harmony)."""
    return tokenizer.reply.think is not None or tokenizer.reply.harmony
