"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/version`),
for the `ollama` packages and the tools built on them. Thin, as the Anthropic adapter: a
request becomes the OpenAI chat (or, `raw`, text) completion request it means, so that the
same mapping, admission, events, stop trimming and cancellation serve it
(http_api/generation.py); answers are Ollama's NDJSON lines, errors `{"error": "..."}`.

Ollama's runtime options (num_ctx, num_gpu, keep_alive, ...) are ignored, as Ollama itself
ignores options a model does not use; what would change the answer in a way this server
cannot do (images, a custom template, context; think for a model that does not reason
apart) is refused with a 400; `format`
(json or a schema) becomes response_format."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import ApiError, from_refusal, validation_problem
from coordinator.http_api.body_parsing import parse_body
from coordinator.http_api.generation import (
    CommitText,
    Generation,
    failure,
    finish_reason,
    openai_encoder,
)
from coordinator.http_api.logprobs_format import LogprobText
from coordinator.http_api.reply_parsing import (
    Reasoning,
    has_reasoning,
    reply_stream,
    split_answer,
)
from coordinator.http_api.request_mapping import (
    PARAM_FIELDS,
    chat_tools,
)
from coordinator.http_api.schemas import ChatCompletionRequest, CompletionRequest
from coordinator.service.admission import Refused
from coordinator.service.messages import RequestResult

# The Ollama server version whose API this follows (clients check it for features).
OLLAMA_VERSION = "0.9.0"
NDJSON = "application/x-ndjson"
# OpenAI field names the shared mapping reports → this API's
_FIELDS = {"max_tokens": "options.num_predict", "temperature": "options.temperature",
           "top_p": "options.top_p", "top_k": "options.top_k", "stop": "options.stop",
           "seed": "options.seed", "response_format.json_schema.schema": "format",
           "response_format": "format", "logprobs": "top_logprobs"}  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Options(_Body):
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    num_predict: int | None = None  # -1: no limit, -2: fill the context (both: the default)
    stop: str | list[str] | None = None
    seed: int | None = None


class ToolFunction(_Body):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(_Body):
    function: ToolFunction


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool's result
    thinking: str | None = None


class _Generating(_Body):
    model: str = Field(min_length=1)
    stream: bool = True
    options: Options | None = None
    format: Any = None
    think: Any = None
    keep_alive: Any = None
    logprobs: bool = False  # each token's logprob (and top_logprobs alternatives)
    top_logprobs: int | None = None


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    template: str | None = None
    suffix: str | None = None
    images: list[Any] | None = None
    context: list[int] | None = None


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # older clients


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status)


def _api_error(err: ApiError) -> JSONResponse:
    message = err.message
    if err.param in _FIELDS:
        message = message.replace(err.param, _FIELDS[err.param])
    return _error(err.status, message)


def _response_format(body: _Generating) -> dict[str, Any]:
    """Ollama's `format` ("json" or a JSON schema) as OpenAI's response_format field."""
    if not body.format:
        return {}
    if body.format == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(body.format, dict):
        schema = {"name": "format", "schema": body.format}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise ApiError(400, f"format: 'json' or a JSON schema, got {body.format!r}")


def _refuse_extras(body: _Generating, images: bool) -> None:
    # `think` is checked against the model where it is known (generate_answer)
    if images:
        raise ApiError(400, "images: this model reads text only")


def _sampling(body: _Generating) -> dict[str, Any]:
    o = body.options or Options()
    max_tokens = o.num_predict
    if max_tokens is not None and max_tokens < 0:
        max_tokens = None  # Ollama's "until the end" (-1) and "fill the context" (-2)
    elif max_tokens == 0:
        raise ApiError(400, "options.num_predict must be at least 1 (or -1: no limit)")
    return {"max_tokens": max_tokens, "temperature": o.temperature, "top_p": o.top_p,
            "top_k": o.top_k, "stop": o.stop, "seed": o.seed}  # fmt: skip


def _logprobs(body: _Generating, chat: bool) -> dict[str, Any]:
    """Ollama's logprobs fields as chat's (logprobs, top_logprobs) or completions' (k)."""
    if not body.logprobs:
        return {"top_logprobs": body.top_logprobs} if body.top_logprobs else {}
    if chat:
        return {"logprobs": True, "top_logprobs": body.top_logprobs}
    return {"logprobs": body.top_logprobs or 0}


def _openai_call(call: ToolCall, i: int, j: int) -> dict[str, Any]:
    return {
        "id": f"call_{i}_{j}",
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


def chat_to_openai(body: ChatRequest) -> ChatCompletionRequest:
    """The OpenAI chat request this /api/chat request means."""
    _refuse_extras(body, any(m.images for m in body.messages))
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            message["tool_calls"] = [_openai_call(c, i, j) for j, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_name:
            message["name"] = m.tool_name
        messages.append(message)
    fields = {"model": body.model, "messages": messages, **_sampling(body)}
    fields.update(_response_format(body), **_logprobs(body, True))
    if body.tools:
        fields["tools"] = body.tools
    return ChatCompletionRequest.model_validate(fields)


def generate_to_openai(body: GenerateRequest, chat: bool):
    """The OpenAI request this /api/generate request means: a chat request through the
    model's template (`chat`), else a text completion of the prompt as it is."""
    _refuse_extras(body, bool(body.images))
    if body.template:
        raise ApiError(400, "template: a custom prompt template is not supported (send raw: "
                       "true with the prompt already formatted)")  # fmt: skip
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported")
    if body.context:
        raise ApiError(400, "context: not supported (send the conversation to /api/chat)")
    if not chat:
        if body.format:
            raise ApiError(400, "format: structured output needs a chat prompt (raw false)")
        return CompletionRequest.model_validate(
            {"model": body.model, "prompt": body.prompt, **_sampling(body),
             **_logprobs(body, False)}
        )  # fmt: skip
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": body.prompt})
    return ChatCompletionRequest.model_validate(
        {"model": body.model, "messages": messages, **_sampling(body), **_response_format(body),
         **_logprobs(body, True)}
    )  # fmt: skip


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":")) + "\n"


def _ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "function": {
            "name": call["function"]["name"],
            "arguments": json.loads(call["function"]["arguments"] or "{}"),
        }
    }


def _stats(result: RequestResult, started_ns: int) -> dict[str, Any]:
    reason = finish_reason(result)
    return {"done": True, "done_reason": reason if reason != "abort" else "stop",
            "total_duration": time.monotonic_ns() - started_ns, "load_duration": 0,
            "prompt_eval_count": result.prompt_tokens,
            "prompt_eval_duration": int(result.prefill_s * 1e9),
            "eval_count": len(result.tokens),
            "eval_duration": int(result.decode_s * 1e9)}  # fmt: skip


def add_ollama_routes(app: FastAPI, backend: ApiBackend, parsing: asyncio.Semaphore) -> None:
    token_text = LogprobText(backend.tokenizer)

    def served(name: str | None) -> bool:
        base = backend.model_name.removesuffix(":latest")
        return name in (base, f"{base}:latest")

    def check(request: Request, model: str | None = None) -> None:
        authorization = request.headers.get("authorization")
        if not backend.key_matches(authorization):
            problem = "invalid API key" if authorization else "missing API key"
            raise ApiError(401, f"unauthorized: {problem} (send 'Authorization: Bearer <key>')")
        if model is not None and not served(model):
            raise ApiError(404, f"model {model!r} not found: this server serves "
                           f"{backend.model_name!r}")  # fmt: skip

    async def read(request: Request, model_cls):
        check(request)
        body = await parse_body(request, model_cls, parsing)
        check(request, getattr(body, "model", None) or getattr(body, "name", None))
        return body

    def errors_answered(handler):
        async def wrapped(request: Request):
            try:
                return await handler(request)
            except ApiError as e:
                return _api_error(e)
            except RequestValidationError as e:
                return _error(400, validation_problem(e)[0])

        wrapped.__name__ = handler.__name__
        return wrapped

    def details() -> dict[str, Any]:
        family = str(getattr(getattr(backend.admission.engine, "config", None), "model_type", ""))
        return {"parent_model": "", "format": "", "family": family,
                "families": [family] if family else None, "parameter_size": "",
                "quantization_level": ""}  # fmt: skip

    def modified_at() -> str:
        return datetime.fromtimestamp(backend.created, UTC).isoformat()

    async def generate_answer(request: Request, body, chat: ChatCompletionRequest
                              | CompletionRequest, kind: str):  # fmt: skip
        if body.think not in (None, False) and not has_reasoning(backend.tokenizer):
            raise ApiError(400, "think: this model does not write its reasoning apart (no "
                           "think markers or harmony channels in its chat template)")  # fmt: skip
        started = time.monotonic_ns()
        try:
            gen = await Generation.start(backend, request, openai_encoder(backend, chat))
        except Refused as e:
            raise from_refusal(e, "max_tokens", PARAM_FIELDS, kind) from None
        # a chat answer is parsed in the model's format: content, thinking, tool calls
        parsed = isinstance(chat, ChatCompletionRequest)
        tools = chat_tools(chat) if parsed else None  # type: ignore[arg-type]
        head = {"model": body.model, "created_at": ""}
        logprobs = gen.job.params.logprobs is not None

        def piece(text: str, calls: list | None = None, entries: list = (),
                  thinking: str = "") -> dict[str, Any]:  # fmt: skip
            extra = {"logprobs": token_text.chat(entries)["content"]} if logprobs else {}
            if kind == "prompt":
                extra |= {"thinking": thinking} if thinking else {}
                return {**head, "created_at": _now(), "response": text, "done": False, **extra}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [_ollama_call(c) for c in calls]
            return {**head, "created_at": _now(), "message": message, "done": False, **extra}

        if body.stream:
            splitter = reply_stream(backend.tokenizer, tools, gen.job.prompt) if parsed else None
            return StreamingResponse(_stream(gen, piece, splitter, started), media_type=NDJSON)
        result = await gen.result()
        if result is None:
            return _error(499, "the client disconnected")
        if result.error:
            raise failure(result)
        text, thinking, calls = result.text, "", []
        if parsed:
            text, thinking, calls = split_answer(backend.tokenizer, text, tools, gen.job.prompt)
        whole = piece(text, calls, gen.job.logprobs, thinking)
        return JSONResponse({**whole, **_stats(result, started)})

    async def _stream(gen: Generation, piece, splitter, started: int):
        """`splitter`: the answer's ReplyStream (None: plain text)."""

        def lines(pieces):
            for p in pieces:
                if isinstance(p, Reasoning):
                    yield _line(piece("", thinking=p))
                else:
                    yield _line(piece(p) if isinstance(p, str) else piece("", p))

        async for p in gen.pieces():
            if isinstance(p, CommitText) and splitter is None:
                yield _line(piece(p, None, p.logprobs))
                continue
            if isinstance(p, str):
                for line in lines(splitter.add(p) if splitter else [p]):
                    yield line
                continue
            if p.error:
                yield _line({"error": failure(p).message})
                return
            for line in lines(splitter.finish() if splitter else []):
                yield line
            yield _line({**piece(""), **_stats(p, started)})

    def loaded(body, kind: str) -> JSONResponse:
        """Ollama's answer to an empty request: the model is loaded (it always is here)."""
        answer = {"model": body.model, "created_at": _now(), "done": True, "done_reason": "load"}
        if kind == "prompt":
            answer["response"] = ""
        else:
            answer["message"] = {"role": "assistant", "content": ""}
        return JSONResponse(answer)

    @errors_answered
    async def chat(request: Request):
        body = await read(request, ChatRequest)
        if not body.messages:
            return loaded(body, "messages")
        return await generate_answer(request, body, chat_to_openai(body), "messages")

    @errors_answered
    async def generate(request: Request):
        body = await read(request, GenerateRequest)
        if not body.prompt and not body.system:
            return loaded(body, "prompt")
        as_chat = not body.raw and backend.tokenizer.has_chat_template
        return await generate_answer(request, body, generate_to_openai(body, as_chat), "prompt")

    @errors_answered
    async def tags(request: Request):
        check(request)
        name = backend.model_name
        return {"models": [{"name": name, "model": name, "modified_at": modified_at(),
                            "size": 0, "digest": hashlib.sha256(name.encode()).hexdigest(),
                            "details": details()}]}  # fmt: skip

    @errors_answered
    async def show(request: Request):
        body = await read(request, ShowRequest)
        if not (body.model or body.name):
            raise ApiError(400, "model is required")
        family = details()["family"] or "unknown"
        return {"modelfile": "", "parameters": "",
                "template": getattr(backend.tokenizer._hf, "chat_template", None) or "",
                "details": details(), "modified_at": modified_at(),
                "model_info": {"general.architecture": family,
                               f"{family}.context_length": backend.context},
                "capabilities": ["completion"]
                + (["tools"] if backend.tokenizer.tool_calling is not None else [])
                + (["thinking"] if has_reasoning(backend.tokenizer) else [])}  # fmt: skip

    async def version():
        return {"version": OLLAMA_VERSION}

    app.add_api_route("/api/chat", chat, methods=["POST"])
    app.add_api_route("/api/generate", generate, methods=["POST"])
    app.add_api_route("/api/tags", tags, methods=["GET"])
    app.add_api_route("/api/show", show, methods=["POST"])
    app.add_api_route("/api/version", version, methods=["GET"])
    # Ollama answers "Ollama is running" at "/": here "/" is the web console, and
    # clients find the API by /api/version and /api/tags.
