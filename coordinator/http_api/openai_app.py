"""The OpenAI-compatible HTTP API (FastAPI): models, chat completions and completions,
streamed or not, over the same admission, engine and jobs as the gRPC API. No decoding
happens here: requests become (prompt ids, GenerationParams), events become chunks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.console.console_routes import add_console
from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import (
    ApiError,
    error_body,
    from_refusal,
    on_api_error,
    on_http_error,
    on_validation_error,
)
from coordinator.http_api.job_events import JobEvents
from coordinator.http_api.request_counting import CountRequests
from coordinator.http_api.request_mapping import (
    PARAM_FIELDS,
    chat_prompt,
    completion_prompt,
    generation_params,
)
from coordinator.http_api.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from coordinator.http_api.stop_text import StopText, trim_at_stop
from coordinator.service.admission import Refused
from coordinator.service.jobs import Job
from coordinator.service.results import ENGINE_STOPPED, OUT_OF_MEMORY

FINISH_REASONS = {"stop": "stop", "length": "length"}  # others: the request was aborted


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Reply:
    """The ids, object names and shapes of one request's answer (chat or text)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        # A text chunk is this prefix, the JSON string, this suffix: built once per
        # request, since a stream sends one per commit.
        head = _sse(self._envelope("chat.completion.chunk" if chat else "text_completion", []))
        head = head.removesuffix("]}\n\n")
        if chat:
            self._text_prefix = head + '{"index":0,"delta":{"content":'
            self._text_suffix = '},"finish_reason":null,"logprobs":null}]}\n\n'
        else:
            self._text_prefix = head + '{"index":0,"text":'
            self._text_suffix = ',"finish_reason":null,"logprobs":null}]}\n\n'

    def _envelope(self, obj: str, choices: list, **extra) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}  # fmt: skip

    def text_chunk(self, text: str) -> str:
        return self._text_prefix + json.dumps(text) + self._text_suffix

    def commit_chunk(self, text: str, forwards: int, tokens: int) -> str:
        """A text chunk that also says how many forwards committed it (stream_commits)."""
        extra = f',"wedlm":{{"forwards":{forwards},"tokens":{tokens}}}}}\n\n'
        return self.text_chunk(text).removesuffix("}\n\n") + extra

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return _sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return _sse(self._envelope("text_completion", [choice]))

    def usage_chunk(self, usage: dict[str, int]) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse(self._envelope(obj, [], usage=usage))

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            return self._envelope("chat.completion", [choice], usage=usage)
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return self._envelope("text_completion", [choice], usage=usage)


def _usage(result: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = result["prompt_tokens"], len(result["tokens"])
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}  # fmt: skip
    # OpenAI's field for prompt tokens served from a cache
    usage["prompt_tokens_details"] = {"cached_tokens": result.get("cached_tokens", 0)}
    if result.get("mode"):  # beyond OpenAI's fields: the decoding that ran, and its caveat
        usage["mode"] = result["mode"]
    usage["forwards"] = result.get("forwards", 0)  # forwards that committed its tokens
    if result.get("warning"):
        usage["warning"] = result["warning"]
    drafted = result.get("drafted_tokens", 0)
    if drafted:  # speculative mode: OpenAI's fields for verified predictions
        accepted = result["accepted_drafts"]
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return usage


def build_app(backend: ApiBackend) -> FastAPI:
    app = FastAPI(title="wedlm-cluster", docs_url=None, redoc_url=None)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_middleware(CountRequests, metrics=backend.metrics)

    async def authorized(authorization: str | None = Header(default=None)) -> None:
        if not backend.key_matches(authorization):
            problem = "Incorrect API key provided" if authorization else "Missing API key"
            raise ApiError(401, f"{problem} (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")  # fmt: skip

    def check_model(name: str) -> None:
        if name != backend.model_name:
            raise ApiError(404, f"The model {name!r} does not exist: this server serves "
                           f"{backend.model_name!r}", "model", "model_not_found")  # fmt: skip

    def admit(body: GenerationFields, chat: bool, events: JobEvents) -> Job:
        """On a worker thread (one hop per request): the chat template and tokenization can
        take milliseconds, and admission may write the job to the store."""
        if chat:
            prompt = chat_prompt(body, backend.tokenizer)  # type: ignore[arg-type]
        else:
            prompt = completion_prompt(body, backend.tokenizer)  # type: ignore[arg-type]
        params = generation_params(body, len(prompt), backend.context, backend.default_max_tokens)
        return backend.admission.accept(prompt, params, 0.0, events.put)

    async def start(body: GenerationFields, chat: bool) -> tuple[Job, JobEvents]:
        check_model(body.model)
        events = JobEvents(asyncio.get_running_loop())
        try:
            job = await run_in_threadpool(admit, body, chat, events)
        except Refused as e:
            raise from_refusal(e, body.limit_field(), PARAM_FIELDS) from None
        return job, events

    async def answer(request: Request, body: GenerationFields, chat: bool):
        job, events = await start(body, chat)
        reply = _Reply(chat, backend.model_name)
        stops = job.params.stop_strings
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(request, job, events, reply, stops, include_usage, body.stream_commits),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            while (event := await events.next(request)) is not None:
                if event[0] == "final":
                    return _whole(reply, event[1], stops)
            return JSONResponse(error_body(499, "the client disconnected"), 499)
        finally:
            if not job.finished:  # the client went away (or the server stops): free its KV
                backend.admission.cancel(job)

    async def _stream(
        request, job, events, reply, stops, include_usage, commits=False
    ) -> AsyncIterator[str]:
        trimmer = StopText(stops)
        forwards = tokens = 0  # committed since the last chunk (stream_commits)
        try:
            if reply.chat:
                yield reply.chunk(None, role=True)
            while (event := await events.next(request, merge=not commits)) is not None:
                if event[0] == "tokens":
                    forwards, tokens = forwards + event[3], tokens + len(event[1])
                    if (text := trimmer.add(event[2])) and commits:
                        yield reply.commit_chunk(text, forwards, tokens)
                        forwards = tokens = 0
                    elif text:
                        yield reply.text_chunk(text)
                    continue
                result = event[1]
                if result.get("error"):
                    failure = _failure(result)
                    yield _sse(error_body(failure.status, failure.message, code=failure.code,
                                          kind=failure.kind))  # fmt: skip
                else:
                    if tail := trimmer.finish():
                        tail_chunk = reply.commit_chunk(tail, forwards, tokens)
                        yield tail_chunk if commits else reply.text_chunk(tail)
                    reason = FINISH_REASONS.get(result["finish_reason"] or "", "abort")
                    yield reply.chunk(None, finish=reason)
                    if include_usage:
                        yield reply.usage_chunk(_usage(result))
                yield "data: [DONE]\n\n"
                return
        finally:
            if not job.finished:  # disconnected mid-stream: cancel, so its KV is freed
                backend.admission.cancel(job)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(backend)]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return _model_card(backend)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await answer(request, body, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        return await answer(request, body, chat=False)

    @app.get("/health")
    @app.get("/health/live")
    async def live() -> JSONResponse:
        ok = backend.alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        ok = backend.ready()
        return JSONResponse({"status": "ready" if ok else "not ready"}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        body = generate_latest(backend.metrics.registry)
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    add_console(app, backend, authorized)  # the web console: `/` and /console/...
    return app


def _failure(result: dict[str, Any]) -> ApiError:
    """A failed generation: out of memory is a 503 server_error (retry later, or ask
    for less), a stopped engine a 503 (the server cannot decode), anything else a 500."""
    kind = result.get("error_kind", "")
    if kind == OUT_OF_MEMORY:
        return ApiError(503, result["error"], code="out_of_memory", kind="server_error")
    if kind == ENGINE_STOPPED:
        return ApiError(503, result["error"], code="engine_stopped")
    return ApiError(500, f"generation failed: {result['error']}", code="generation_failed")


def _whole(reply: _Reply, result: dict[str, Any], stops: tuple[str, ...]) -> JSONResponse:
    if result.get("error"):
        raise _failure(result)
    reason = FINISH_REASONS.get(result["finish_reason"] or "", "abort")
    text = trim_at_stop(result["text"], stops)
    return JSONResponse(reply.whole(text, reason, _usage(result)))


def _model_card(backend: ApiBackend) -> dict[str, Any]:
    return {"id": backend.model_name, "object": "model", "created": backend.created,
            "owned_by": "wedlm-cluster", "max_model_len": backend.context,
            "default_mode": backend.default_mode}  # fmt: skip
