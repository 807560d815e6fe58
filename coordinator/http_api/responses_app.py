"""OpenAI's Responses API (`POST /v1/responses`), for `client.responses.create(...)`. Thin,
as the other adapters: a request becomes the OpenAI chat request it means (instructions
as the system message, input items as messages), so that the same mapping, admission,
events, stop trimming and cancellation serve it (http_api/generation.py); the answer is a
response object (one message item of output_text) or its stream of typed events. Errors
keep OpenAI's shape. Nothing is stored: `store: true`, `previous_response_id` and
`background` are refused; `text.format` json_object and json_schema give structured
output. Function tools are chat's tools: `function_call` and `function_call_output` input
items become the assistant's calls and the tool results, `tool_choice` the chat one, and
the answer's reasoning, text and calls (parsed in the model's own format, reply_parsing.py)
become reasoning, message and function_call output items (responses_items.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import ApiError, error_body, from_refusal
from coordinator.http_api.body_parsing import parse_body
from coordinator.http_api.generation import (
    Generation,
    event_stream,
    failure,
    finish_reason,
    openai_encoder,
)
from coordinator.http_api.reply_parsing import reply_stream, split_answer
from coordinator.http_api.request_mapping import PARAM_FIELDS, chat_tools
from coordinator.http_api.responses_items import ItemStream, message_item, output_items
from coordinator.http_api.schemas import ChatCompletionRequest
from coordinator.service.admission import Refused
from coordinator.service.messages import RequestResult

_TEXT_PARTS = ("input_text", "output_text", "text")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Part(_Body):
    type: str
    text: str | None = None


class Item(_Body):
    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    # function_call and function_call_output items
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None


def _refused(body: ResponsesRequest) -> None:
    if body.store:
        raise ApiError(400, "store: responses are not stored on this server (send store: "
                       "false, or leave it out)", "store")  # fmt: skip
    if body.previous_response_id:
        raise ApiError(400, "previous_response_id: nothing is stored on this server; send "
                       "the conversation in input", "previous_response_id")  # fmt: skip
    if body.background:
        raise ApiError(400, "background: background responses are not supported", "background")


def _tools(body: ResponsesRequest) -> dict[str, Any]:
    """Function tools and tool_choice as chat's fields."""
    if not body.tools:
        return {}
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise ApiError(400, f"tools[{i}]: only function tools (type function, with a "
                           f"name) are served here, got type {tool.get('type')!r}",
                           f"tools[{i}].type")  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice: 'none', 'auto', 'required' or {\"type\": "
                           "\"function\", \"name\": ...}", "tool_choice")  # fmt: skip
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return {"tools": tools, "tool_choice": choice}


def _call_message(i: int, item: Item) -> dict[str, Any]:
    if item.call_id is None or item.name is None:
        raise ApiError(400, f"input[{i}]: a function_call item needs call_id and name",
                       f"input[{i}]")  # fmt: skip
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments or "{}"}}  # fmt: skip
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _content(i: int, content: str | list[Part] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, p in enumerate(content):
        if p.type not in _TEXT_PARTS or p.text is None:
            raise ApiError(400, f"input[{i}].content[{j}]: parts of type {p.type!r} are not "
                           "supported (text only)", f"input[{i}].content[{j}].type")  # fmt: skip
        parts.append(p.text)
    return "".join(parts)


def to_openai(body: ResponsesRequest) -> ChatCompletionRequest:
    """The OpenAI chat request this Responses request means."""
    _refused(body)
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            if item.type == "reasoning":  # a past turn's reasoning: templates drop it
                continue
            if item.type == "function_call":
                call = _call_message(i, item)
                last = messages[-1] if messages else {}
                if last.get("role") == "assistant" and last.get("tool_calls"):
                    last["tool_calls"] += call["tool_calls"]  # parallel calls: one turn
                else:
                    messages.append(call)
                continue
            if item.type == "function_call_output":
                if item.call_id is None:
                    raise ApiError(400, f"input[{i}]: a function_call_output item needs "
                                   "call_id", f"input[{i}].call_id")  # fmt: skip
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": _content(i, item.output)})  # fmt: skip
                continue
            if item.type != "message" or item.role is None:
                raise ApiError(400, f"input[{i}]: items of type {item.type!r} are not "
                               "supported (messages, function_call, function_call_output, "
                               "reasoning)", f"input[{i}].type")  # fmt: skip
            messages.append({"role": item.role, "content": _content(i, item.content)})
    if not messages:
        raise ApiError(400, "input must not be empty", "input")
    return ChatCompletionRequest.model_validate({
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "response_format": _response_format(body), **_tools(body)})  # fmt: skip


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as chat's response_format: Responses flattens json_schema's fields."""
    fmt = (body.text or {}).get("format") or {}
    kind = fmt.get("type", "text")
    if kind == "text":  # free text: no grammar (one a tool_choice may then set)
        return None
    if kind == "json_object":
        return {"type": kind}
    if kind == "json_schema":
        if "schema" not in fmt:
            raise ApiError(400, "text.format.schema is required", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got "
                   f"{kind!r}", "text.format.type")  # fmt: skip


def _sse(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Response:
    """One answer's ids and its response object at each stage."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body, self.model = body, model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def obj(
        self, status: str, result: RequestResult | None = None, items: list | None = None
    ) -> dict[str, Any]:
        """`items`: the output items (the answer's parts); `result`'s text as one message
        when not given."""
        b = self.body
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": [], "output_text": "",
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature, "top_p": b.top_p, "error": None,
            "incomplete_details": None, "metadata": b.metadata or {}, "store": False,
            "parallel_tool_calls": False, "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "previous_response_id": None, "text": self.body.text or {"format": {"type": "text"}},
            "truncation": "disabled", "usage": None}  # fmt: skip
        if result is not None:
            item_status = "completed" if status == "completed" else "incomplete"
            if items is None:
                items = [message_item(self.item_id, result.text, item_status)]
            out["output"] = items
            out["output_text"] = "".join(
                p["text"] for i in items if i["type"] == "message" for p in i["content"]
            )
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            prompt, output = result.prompt_tokens, len(result.tokens)
            out["usage"] = {"input_tokens": prompt, "output_tokens": output,
                            "total_tokens": prompt + output,
                            "input_tokens_details": {"cached_tokens":
                                                     result.cached_tokens},
                            "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
        return out


def _status(result: RequestResult) -> str:
    return "incomplete" if finish_reason(result) == "length" else "completed"


def add_responses_routes(
    app: FastAPI,
    backend: ApiBackend,
    parsing,
    authorized: Callable,
    check_model: Callable[[str], None],
) -> None:
    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def responses(request: Request):
        body = await parse_body(request, ResponsesRequest, parsing)
        check_model(body.model)
        chat = to_openai(body)
        try:
            gen = await Generation.start(backend, request, openai_encoder(backend, chat))
        except ApiError as e:
            raise _renamed(e) from None
        except Refused as e:
            raise _renamed(from_refusal(e, "max_tokens", PARAM_FIELDS, "input")) from None
        reply = _Response(body, backend.model_name)
        tools = chat_tools(chat)
        if body.stream:
            return event_stream(_stream(gen, reply, tools))
        result = await gen.result()
        if result is None:
            return JSONResponse(error_body(499, "the client disconnected"), 499)
        if result.error:
            raise failure(result)
        status = _status(result)
        content, reasoning, calls = split_answer(backend.tokenizer, result.text, tools,
                                                 gen.job.prompt)  # fmt: skip
        item_status = "completed" if status == "completed" else "incomplete"
        items = output_items(reply.item_id, content, reasoning, calls, item_status)
        return JSONResponse(reply.obj(status, result, items))

    async def _stream(gen: Generation, reply: _Response, tools: list | None):
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return _sse({"type": kind, "sequence_number": seq - 1, **fields})

        yield event("response.created", response=reply.obj("in_progress"))
        yield event("response.in_progress", response=reply.obj("in_progress"))
        splitter = reply_stream(backend.tokenizer, tools, gen.job.prompt)
        items = ItemStream(event, reply.item_id)
        async for piece in gen.pieces():
            if isinstance(piece, str):
                for e in items.add(splitter.add(piece) if splitter else [piece]):
                    yield e
                continue
            result = piece
            if result.error:
                err = failure(result)
                yield event("error", code=err.code, message=err.message, param=None)
                failed = {**reply.obj("failed"), "error": {"code": err.code or "server_error",
                                                           "message": err.message}}  # fmt: skip
                yield event("response.failed", response=failed)
                return
            status = _status(result)
            for e in items.add(splitter.finish() if splitter else []):
                yield e
            for e in items.finish("completed" if status == "completed" else "incomplete"):
                yield e
            yield event(f"response.{status}", response=reply.obj(status, result, items.items))


def _renamed(err: ApiError) -> ApiError:
    """The shared mapping's field names → this API's."""
    if err.param == "max_tokens":
        err.message = err.message.replace("max_tokens", "max_output_tokens")
        err.param = "max_output_tokens"
    elif err.param == "messages":
        err.message = err.message.replace("messages", "input")
        err.param = "input"
    return err
