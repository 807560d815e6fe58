"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), for the
`anthropic` packages and tools built on them. Thin: a request becomes the OpenAI chat
request it means, so that the same mapping (chat template, GenerationParams), admission,
events, stop trimming and cancellation serve it (http_api/generation.py); the answer and
errors take Anthropic's shapes."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import ApiError, from_refusal, validation_problem
from coordinator.http_api.body_parsing import parse_body
from coordinator.http_api.generation import (
    Generation,
    event_stream,
    failure,
    finish_reason,
    openai_encoder,
)
from coordinator.http_api.reply_parsing import (
    Reasoning,
    has_reasoning,
    reply_stream,
    split_answer,
)
from coordinator.http_api.request_mapping import (
    PARAM_FIELDS,
    chat_prompt,
    chat_tools,
)
from coordinator.http_api.schemas import ChatCompletionRequest
from coordinator.service.admission import Refused
from coordinator.service.messages import RequestResult

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 499: "invalid_request_error"}  # fmt: skip
# OpenAI field names the shared mapping reports → this API's
_FIELDS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Body):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class CountRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    thinking: dict[str, Any] | None = None


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _error(err: ApiError) -> JSONResponse:
    message = err.message
    for ours, theirs in _FIELDS.items():
        if err.param == ours:
            message = message.replace(ours, theirs)
    return JSONResponse(error_body(err.status, message), err.status)


def _text(i: int, blocks: str | list[Block] | None, where: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise ApiError(400, f"{where}[{j}]: blocks of type {b.type!r} are not supported "
                           "here (text only)", f"{where}[{j}].type")  # fmt: skip
        parts.append(b.text)
    return "".join(parts)


def _tool_result_text(block: Block) -> str:
    if isinstance(block.content, list):
        return "".join(p.get("text", "") for p in block.content if p.get("type") == "text")
    return block.content or ""


def to_openai(body: CountRequest, max_tokens: int | None = None) -> ChatCompletionRequest:
    """The OpenAI chat request this Messages request means."""
    choice = (body.tool_choice or {}).get("type")
    if choice not in (None, "auto", "none", "any", "tool"):
        raise ApiError(400, "tool_choice.type: auto, none, any or tool", "tool_choice")
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(0, body.system, "system")})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, b in enumerate(m.content):
            if b.type == "text" and b.text is not None:
                text.append(b.text)
            elif b.type == "tool_use" and m.role == "assistant" and b.name:
                calls.append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input or {})}})  # fmt: skip
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # a past turn's reasoning, sent back: templates render turns without it
            elif b.type == "tool_result" and m.role == "user":
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": _tool_result_text(b)})  # fmt: skip
            else:
                raise ApiError(400, f"messages[{i}].content[{j}]: blocks of type {b.type!r} "
                               f"are not supported in a {m.role} message",
                               f"messages[{i}].content[{j}].type")  # fmt: skip
        if text or calls or m.role == "assistant":
            message: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    fields: dict[str, Any] = {"model": body.model, "messages": messages,
                              "max_tokens": max_tokens}  # fmt: skip
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in body.tools]  # fmt: skip
        # any and a named tool: OpenAI's required and named function (a grammar)
        if choice in ("none", "any"):
            fields["tool_choice"] = "required" if choice == "any" else "none"
        elif choice == "tool":
            name = body.tool_choice.get("name")  # type: ignore[union-attr]
            fields["tool_choice"] = {"type": "function", "function": {"name": name}}
    if isinstance(body, MessagesRequest):
        fields.update(stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k)  # fmt: skip
    return ChatCompletionRequest.model_validate(fields)


def _sse(event: str, payload: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _block_start(index: int, block: dict[str, Any]) -> str:
    payload = {"type": "content_block_start", "index": index, "content_block": block}
    return _sse("content_block_start", payload)


def _delta(index: int, delta: dict[str, Any]) -> str:
    payload = {"type": "content_block_delta", "index": index, "delta": delta}
    return _sse("content_block_delta", payload)


def _block_stop(index: int) -> str:
    return _sse("content_block_stop", {"type": "content_block_stop", "index": index})


def _input_usage(result: RequestResult) -> dict[str, int]:
    """Anthropic's split of the prompt: `input_tokens` are the ones computed, the rows taken
    from the prefix cache are `cache_read_input_tokens` (clients add the three for the
    context size). Nothing is written on request (no cache_control), so creation is 0."""
    cached = min(result.cached_tokens, result.prompt_tokens)
    return {"input_tokens": result.prompt_tokens - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}  # fmt: skip


def _stop_reason(result: RequestResult, calls: bool) -> str:
    reason = finish_reason(result)
    if reason == "length":
        return "max_tokens"
    if reason == "stop" and calls:
        return "tool_use"
    return "stop_sequence" if result.stop_sequence else "end_turn"


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1),
            "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"] or "{}")}  # fmt: skip


def add_anthropic_routes(app: FastAPI, backend: ApiBackend, parsing: asyncio.Semaphore) -> None:
    def check(request: Request, model: str | None = None) -> None:
        key = request.headers.get("x-api-key")
        authorization = f"Bearer {key}" if key else request.headers.get("authorization")
        if not backend.key_matches(authorization):
            problem = "invalid x-api-key" if authorization else "missing API key"
            raise ApiError(401, f"{problem} (send 'x-api-key: <key>')")
        if model is not None and model != backend.model_name:
            raise ApiError(404, f"model: {model!r} is not served here; this server serves "
                           f"{backend.model_name!r}", "model")  # fmt: skip

    async def read(request: Request, model_cls):
        check(request)
        body = await parse_body(request, model_cls, parsing)
        check(request, body.model)
        return body

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            body = await read(request, CountRequest)
            chat = to_openai(body)
            prompt = await asyncio.to_thread(chat_prompt, chat, backend.tokenizer,
                                             backend.context)  # fmt: skip
            return {"input_tokens": len(prompt)}
        except ApiError as e:
            return _error(e)
        except RequestValidationError as e:
            message, _ = validation_problem(e)
            return JSONResponse(error_body(400, message), 400)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            body = await read(request, MessagesRequest)
            thinks = has_reasoning(backend.tokenizer)  # its reasoning comes as thinking blocks
            if body.thinking and body.thinking.get("type") == "enabled" and not thinks:
                raise ApiError(400, "thinking: this model does not write its reasoning apart "
                               "(no think markers or harmony channels in its chat template)",
                               "thinking")  # fmt: skip
            chat = to_openai(body, body.max_tokens)
            try:
                gen = await Generation.start(backend, request, openai_encoder(backend, chat))
            except Refused as e:
                raise from_refusal(e, "max_tokens", PARAM_FIELDS, "messages") from None
        except ApiError as e:
            return _error(e)
        except RequestValidationError as e:
            message, _ = validation_problem(e)
            return JSONResponse(error_body(400, message), 400)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        tools = chat_tools(chat)
        if body.stream:
            return event_stream(_stream(gen, message_id, tools))
        result = await gen.result()
        if result is None:
            return JSONResponse(error_body(499, "the client disconnected"), 499)
        if result.error:
            return _error(failure(result))
        text, thinking, calls = split_answer(backend.tokenizer, result.text, tools,
                                             gen.job.prompt)  # fmt: skip
        content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
        content += [{"type": "text", "text": text}] if text or not (calls or thinking) else []
        content += [_tool_use(c) for c in calls]
        return {"id": message_id, "type": "message", "role": "assistant",
                "model": backend.model_name, "content": content,
                "stop_reason": _stop_reason(result, bool(calls)),
                "stop_sequence": result.stop_sequence,
                "usage": {**_input_usage(result),
                          "output_tokens": len(result.tokens)}}  # fmt: skip

    async def _stream(gen: Generation, message_id: str, tools):
        splitter = reply_stream(backend.tokenizer, tools, gen.job.prompt)
        index, open_kind = 0, ""  # the open block's type: "text", "thinking" or none
        start = {"id": message_id, "type": "message", "role": "assistant",
                 "model": backend.model_name, "content": [], "stop_reason": None,
                 "stop_sequence": None,
                 # the cached rows are known once it ran: message_delta gives the split
                 "usage": {"input_tokens": gen.prompt_tokens, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": 0, "output_tokens": 0}}  # fmt: skip
        yield _sse("message_start", {"type": "message_start", "message": start})

        def blocks(pieces):
            nonlocal index, open_kind
            for piece in pieces:
                if isinstance(piece, str):
                    kind = "thinking" if isinstance(piece, Reasoning) else "text"
                    if open_kind != kind:
                        if open_kind:
                            yield _block_stop(index)
                            index += 1
                        open_kind = kind
                        empty = {"thinking": "", "signature": ""} if kind == "thinking" else {
                            "text": ""}  # fmt: skip
                        yield _block_start(index, {"type": kind, **empty})
                    yield _delta(index, {"type": f"{kind}_delta", kind: piece})
                    continue
                for call in piece:
                    if open_kind:
                        yield _block_stop(index)
                        index, open_kind = index + 1, ""
                    use = _tool_use(call)
                    yield _block_start(index, {**use, "input": {}})
                    partial = json.dumps(use["input"])
                    yield _delta(index, {"type": "input_json_delta", "partial_json": partial})
                    yield _block_stop(index)
                    index += 1

        async for piece in gen.pieces():
            if isinstance(piece, str):
                for event in blocks(splitter.add(piece) if splitter else [piece]):
                    yield event
                continue
            result = piece
            if result.error:
                err = failure(result)
                yield _sse("error", error_body(err.status, err.message))
                return
            for event in blocks(splitter.finish() if splitter else []):
                yield event
            if not open_kind and index == 0:  # an empty answer is one empty text block
                for event in blocks([""]):
                    yield event
            if open_kind:
                yield _block_stop(index)
            calls = bool(splitter and splitter.calls)
            delta = {"stop_reason": _stop_reason(result, calls),
                     "stop_sequence": result.stop_sequence}  # fmt: skip
            yield _sse("message_delta", {"type": "message_delta", "delta": delta,
                       "usage": {**_input_usage(result),
                                 "output_tokens": len(result.tokens)}})  # fmt: skip
            yield _sse("message_stop", {"type": "message_stop"})
