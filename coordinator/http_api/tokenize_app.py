"""vLLM's /tokenize and /detokenize: the token ids this server would decode from (a
completion prompt as /v1/completions encodes it, or chat messages through the chat template
as /v1/chat/completions renders them), and the text of token ids. Clients check a prompt's
length, or tokenize as the server does, before they send it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import ApiError
from coordinator.http_api.body_parsing import parse_body
from coordinator.http_api.request_mapping import chat_prompt, completion_prompts
from coordinator.http_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


def _tokenize(backend: ApiBackend, body: TokenizeRequest) -> list[int]:
    """Exactly the ids a completion or chat request with this prompt would decode from
    (refused alike: a prompt longer than the context is a 400, as it would be there)."""
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send either prompt (a completion's) or messages (a chat's)",
                       "prompt" if body.prompt is None else "messages")  # fmt: skip
    model = backend.model_name
    if body.prompt is not None:
        if not body.add_special_tokens:
            raise ApiError(400, "add_special_tokens: only true (what /v1/completions encodes)",
                           "add_special_tokens")  # fmt: skip
        request = CompletionRequest(model=model, prompt=body.prompt)
        return completion_prompts(request, backend.tokenizer, backend.context)[0]
    if not body.add_generation_prompt:
        raise ApiError(400, "add_generation_prompt: only true (what /v1/chat/completions "
                       "renders)", "add_generation_prompt")  # fmt: skip
    if not body.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    chat = ChatCompletionRequest(model=model, messages=body.messages, tools=body.tools)
    return chat_prompt(chat, backend.tokenizer, backend.context)


def add_tokenize_routes(
    app: FastAPI,
    backend: ApiBackend,
    parsing: asyncio.Semaphore,
    authorized: Callable,
    check_model: Callable[[str], None],
) -> None:
    token_strs = backend.tokenizer.token_bytes

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest, parsing)
        if body.model is not None:
            check_model(body.model)
        ids = await run_in_threadpool(_tokenize, backend, body)
        strs = None
        if body.return_token_strs:
            strs = [token_strs(t).decode("utf-8", errors="backslashreplace") for t in ids]
        return {"count": len(ids), "max_model_len": backend.context, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest, parsing)
        if body.model is not None:
            check_model(body.model)
        vocab = backend.admission.engine.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: token ids outside the vocabulary [0, {vocab}): "
                           f"{bad[:5]}", "tokens")  # fmt: skip
        if len(body.tokens) > backend.context:
            raise ApiError(400, f"tokens: at most the model's context, {backend.context} ids, "
                           f"got {len(body.tokens)}", "tokens")  # fmt: skip
        text = await run_in_threadpool(backend.tokenizer.decode, body.tokens)
        return {"prompt": text}
