"""The session on the wire: the conversation up to a turn in each API's own form (chat
completions with tools and tool messages; Anthropic Messages with tool_use and tool_result
blocks), and one streamed turn through that API's official package, timed from the request
to its first content and to its end. The model's own answers are never sent back: every
turn's prompt extends the previous one, as an agent's does."""

from __future__ import annotations

import json
from dataclasses import dataclass

from wedlm_client.bench.agent_session import Session
from wedlm_client.bench.records import now


@dataclass
class TurnTiming:
    """One turn as the client saw it; token counts are the server's (None: not reported)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    decode_s: float | None = None  # from the first content to the last
    total_s: float = 0.0
    content_events: int = 0


def openai_tools(session: Session) -> list[dict]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}}
            for t in session.tools]  # fmt: skip


def openai_messages(session: Session, upto: int) -> list[dict]:
    """System, then per turn: user, assistant (the tool call alone), tool."""
    messages: list[dict] = [{"role": "system", "content": session.system}]
    for turn in session.turns[:upto]:
        call = {"id": turn.call_id, "type": "function",
                "function": {"name": turn.tool, "arguments": json.dumps(turn.arguments)}}
        messages += [{"role": "user", "content": turn.user},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": turn.call_id, "content": turn.result}]
    return messages  # fmt: skip


def anthropic_tools(session: Session) -> list[dict]:
    return [{"name": t.name, "description": t.description, "input_schema": t.parameters}
            for t in session.tools]  # fmt: skip


def anthropic_messages(session: Session, upto: int) -> list[dict]:
    """Per turn: user text, assistant tool_use, user tool_result (the next turn's user text
    follows it as a user message of its own, which the Messages API joins to it)."""
    messages: list[dict] = []
    for turn in session.turns[:upto]:
        use_id = turn.call_id.replace("call_", "toolu_", 1)
        messages += [
            {"role": "user", "content": [{"type": "text", "text": turn.user}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": use_id,
                                               "name": turn.tool, "input": turn.arguments}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id,
                                          "content": turn.result}]},
        ]  # fmt: skip
    return messages


def _close(t: TurnTiming, t0: float, events: list[float]) -> TurnTiming:
    t.total_s = now() - t0
    t.content_events = len(events)
    if events:
        t.ttft_s = events[0] - t0
        t.decode_s = events[-1] - events[0]
    return t


def openai_turn(client, model: str, session: Session, upto: int, max_tokens: int) -> TurnTiming:
    """One streamed chat completion; usage from its final chunk."""
    timing, events = TurnTiming(), []
    t0 = now()
    stream = client.chat.completions.create(
        model=model, messages=openai_messages(session, upto), tools=openai_tools(session),
        max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    try:
        for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta
                if delta is not None and (delta.content or delta.tool_calls
                                          or getattr(delta, "reasoning_content", None)):
                    events.append(now())  # fmt: skip
            if chunk.usage is not None:
                use = chunk.usage
                timing.prompt_tokens, timing.completion_tokens = (use.prompt_tokens,
                                                                  use.completion_tokens)
                details = getattr(use, "prompt_tokens_details", None)
                timing.cached_tokens = getattr(details, "cached_tokens", None)  # fmt: skip
    finally:
        stream.close()
    return _close(timing, t0, events)


def anthropic_turn(client, model: str, session: Session, upto: int,
                   max_tokens: int) -> TurnTiming:  # fmt: skip
    """One streamed Messages call; usage from message_start, updated by message_delta (where
    a server that knows its cached rows only at the end says them)."""
    timing, events, usage = TurnTiming(), [], {}
    t0 = now()
    stream = client.messages.create(
        model=model, system=session.system, tools=anthropic_tools(session),
        messages=anthropic_messages(session, upto), max_tokens=max_tokens, stream=True,
        extra_body={"temperature": 0},  # not an argument of the package's 2.x
    )  # fmt: skip
    try:
        for event in stream:
            if event.type == "content_block_delta":
                events.append(now())
            elif event.type in ("message_start", "message_delta"):
                use = event.message.usage if event.type == "message_start" else event.usage
                usage.update({k: v for k, v in use.model_dump().items() if v is not None})
    finally:
        stream.close()
    if "input_tokens" in usage:
        cached = usage.get("cache_read_input_tokens")
        timing.prompt_tokens = (usage["input_tokens"] + (cached or 0)
                                + (usage.get("cache_creation_input_tokens") or 0))  # fmt: skip
        timing.cached_tokens = cached
    timing.completion_tokens = usage.get("output_tokens")
    return _close(timing, t0, events)
