"""The OpenAI-compatible HTTP API (FastAPI): models, chat completions and completions,
streamed or not, over the same admission, engine and jobs as the gRPC API; the other APIs'
routes, health, metrics and the console join the same app. No decoding happens here:
requests become (prompt ids, GenerationParams), events become chunks
(openai_completions.py answers, openai_stream.py streams)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.console.console_routes import add_console
from coordinator.http_api.anthropic_app import add_anthropic_routes
from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import (
    ApiError,
    on_api_error,
    on_http_error,
    on_validation_error,
)
from coordinator.http_api.api_support import API_SUPPORT
from coordinator.http_api.body_limit import LimitBody
from coordinator.http_api.body_parsing import PARSING_AT_ONCE, parse_body
from coordinator.http_api.ollama_app import add_ollama_routes
from coordinator.http_api.openai_completions import OpenAiCompletions
from coordinator.http_api.reply_parsing import has_reasoning
from coordinator.http_api.request_counting import CountRequests
from coordinator.http_api.responses_app import add_responses_routes
from coordinator.http_api.schemas import ChatCompletionRequest, CompletionRequest
from coordinator.http_api.tokenize_app import add_tokenize_routes


def build_app(backend: ApiBackend) -> FastAPI:
    app = FastAPI(title="wedlm-cluster", docs_url=None, redoc_url=None)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    # The last added runs first: CountRequests sees everything (refused bodies and
    # preflights too), CORS answers preflights and adds its headers to every answer, the
    # body limit's 413 included, so that a browser can read it.
    app.add_middleware(LimitBody, max_bytes=backend.max_request_bytes)
    if backend.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(backend.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["*"],
        )
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

    openai = OpenAiCompletions(backend, check_model)  # /v1/chat/completions, /v1/completions

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(backend)]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return _model_card(backend)

    # The bodies are read after the API key is checked, and parsed off the event loop.
    parsing = asyncio.Semaphore(PARSING_AT_ONCE)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest, parsing)
        return await openai.answer(request, body, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest, parsing)
        return await openai.answer(request, body, chat=False)

    add_anthropic_routes(app, backend, parsing)  # /v1/messages
    add_ollama_routes(app, backend, parsing)  # /api/chat, /api/generate, ...
    add_responses_routes(app, backend, parsing, authorized, check_model)  # /v1/responses
    add_tokenize_routes(app, backend, parsing, authorized, check_model)  # vLLM's /tokenize

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


def _model_card(backend: ApiBackend) -> dict[str, Any]:
    return {"id": backend.model_name, "object": "model", "created": backend.created,
            "owned_by": "wedlm-cluster", "max_model_len": backend.context,
            "default_mode": backend.default_mode,
            "tool_calling": backend.tokenizer.tool_calling is not None,
            # the answer's format, read from the checkpoint (reply_parsing.py)
            "tool_call_format": getattr(backend.tokenizer.tool_calling, "format", None),
            "reasoning": has_reasoning(backend.tokenizer),
            "apis": API_SUPPORT}  # fmt: skip
