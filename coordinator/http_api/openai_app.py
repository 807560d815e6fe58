"""The OpenAI-compatible HTTP API (FastAPI): models, chat completions and completions,
streamed or not, over the same admission, engine and jobs as the gRPC API. No decoding
happens here: requests become (prompt ids, GenerationParams), events become chunks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.console.console_routes import add_console
from coordinator.engine.token_logprobs import PromptLogprob
from coordinator.http_api.anthropic_app import add_anthropic_routes
from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import (
    ApiError,
    error_body,
    from_refusal,
    on_api_error,
    on_http_error,
    on_validation_error,
)
from coordinator.http_api.body_limit import LimitBody
from coordinator.http_api.body_parsing import PARSING_AT_ONCE, parse_body
from coordinator.http_api.generation import (
    CommitText,
    Generation,
    event_stream,
    failure,
    finish_reason,
    openai_encoder,
)
from coordinator.http_api.logprobs_format import LogprobText
from coordinator.http_api.ollama_app import add_ollama_routes
from coordinator.http_api.reply_parsing import Reasoning, has_reasoning, reply_stream, split_answer
from coordinator.http_api.request_counting import CountRequests
from coordinator.http_api.request_mapping import (
    PARAM_FIELDS,
    chat_tools,
    completion_prompts,
)
from coordinator.http_api.responses_app import add_responses_routes
from coordinator.http_api.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from coordinator.http_api.tokenize_app import add_tokenize_routes
from coordinator.service.admission import Refused
from coordinator.service.messages import RequestResult

# What each API serves and refuses (also the README's table).
API_SUPPORT = {
    "openai_chat": {"path": "/v1/chat/completions",
                    "supports": ["stream", "stop", "temperature", "top_p", "seed", "tools",
                                 "tool_choice auto/none/required/named",
                                 "max_completion_tokens", "logprobs", "top_logprobs<=20",
                                 "response_format json_object/json_schema", "n<=16",
                                 "presence/frequency penalties", "logit_bias",
                                 "repetition_penalty"],
                    "refuses": ["response_format with a required tool call"]},
    "openai_completions": {"path": "/v1/completions",
                           "supports": ["stream", "stop", "temperature", "top_p", "seed",
                                        "token-id prompts", "lists of prompts",
                                        "logprobs<=20", "n<=16", "penalties", "logit_bias",
                                        "echo (with prompt logprobs)", "max_tokens 0 (echo)"],
                           "refuses": ["best_of>1", "suffix",
                                       "a streamed echo with logprobs and n>1"]},
    "tokenize": {"path": "/tokenize, /detokenize",
                 "supports": ["prompt", "messages", "tools", "return_token_strs"],
                 "refuses": ["add_special_tokens false", "add_generation_prompt false"]},
    "anthropic_messages": {"path": "/v1/messages",
                           "supports": ["system", "stream", "stop_sequences", "temperature",
                                        "top_p", "top_k", "tool_use/tool_result blocks",
                                        "count_tokens", "tool_choice any/tool",
                                        "thinking blocks (a model that reasons apart)"],
                           "refuses": ["image/document blocks",
                                       "thinking (a model without reasoning markers)"]},
    "openai_responses": {"path": "/v1/responses",
                         "supports": ["input string or message items", "instructions",
                                      "max_output_tokens", "temperature", "top_p", "stream",
                                      "function tools", "function_call and "
                                      "function_call_output items", "tool_choice",
                                      "reasoning items"],
                         "refuses": ["store true", "previous_response_id", "background",
                                     "non-function tools", "non-text input"]},
    "ollama": {"path": "/api/chat, /api/generate, /api/tags, /api/show, /api/version",
               "supports": ["stream (NDJSON)", "system", "raw", "options temperature/top_p/"
                            "top_k/num_predict/stop/seed", "tools", "model name or name:latest",
                            "format json/schema", "logprobs"],
               "refuses": ["images", "think (a model without reasoning markers)",
                           "template", "suffix", "context"]},
}  # fmt: skip


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class _Echo:
    """What a completion with `echo` answers before its own text."""

    text: str  # the prompt as sent (token ids: decoded)
    first: int  # the prompt's first token (it has no logprob)
    drop: bool  # max_tokens 0: the one token decoded is not answered


class _Reply:
    """The ids, object names and shapes of one request's answer (chat or text)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        index: int = 0,
        first: _Reply | None = None,
        echo: _Echo | None = None,
    ):
        """`index`: the choice (n > 1, several prompts); `first`: choice 0's reply, whose
        id it shares; `echo`: its prompt, answered first (completions' echo)."""
        self.chat = chat
        self.echo = echo
        self.id = first.id if first else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = first.created if first else int(time.time())
        self.index = index
        self.call_index = 0  # of the next streamed tool call
        self.text_offset = 0  # completions' logprobs: characters answered so far
        # A text chunk is this prefix, the JSON string, this suffix: built once per
        # request, since a stream sends one per commit.
        head = _sse(self._envelope("chat.completion.chunk" if chat else "text_completion", []))
        head = head.removesuffix("]}\n\n")
        if chat:
            self._text_prefix = head + f'{{"index":{index},"delta":{{"content":'
            self._text_suffix = '},"finish_reason":null,"logprobs":null}]}\n\n'
        else:
            self._text_prefix = head + f'{{"index":{index},"text":'
            self._text_suffix = ',"finish_reason":null,"logprobs":null}]}\n\n'

    def _envelope(self, obj: str, choices: list, **extra) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}  # fmt: skip

    def text_chunk(self, text: str, logprobs: dict[str, Any] | None = None) -> str:
        if logprobs is None:
            return self._text_prefix + json.dumps(text) + self._text_suffix
        if self.chat:
            choice = {"index": self.index, "delta": {"content": text}, "finish_reason": None,
                      "logprobs": logprobs}  # fmt: skip
            return _sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": self.index, "text": text, "finish_reason": None, "logprobs": logprobs}
        return _sse(self._envelope("text_completion", [choice]))

    def logprobs(self, entries: list, text: LogprobText) -> dict[str, Any]:
        """Entries in this API's shape (completions count characters across chunks)."""
        if self.chat:
            return text.chat(entries)
        found = text.completion(entries, self.text_offset)
        if found["tokens"]:
            self.text_offset = found["text_offset"][-1] + len(found["tokens"][-1])
        return found

    def echoed(
        self,
        text: str,
        entries: list,
        leader: list,
        token_text: LogprobText,
        logprobs: bool,
        answer: bool = True,
    ) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt, then `text` (dropped when echo only), and with `logprobs`
        their tokens' (the prompt's from `leader`: its prompt's first choice's entries,
        the generated ones from `entries`; `answer` False: the prompt's only, a stream's
        first chunk). Later chunks' offsets continue after them."""
        echo = self.echo
        assert echo is not None
        keep = answer and not echo.drop
        whole = echo.text + (text if keep else "")
        self.text_offset = len(echo.text)
        if not logprobs:
            return whole, None
        prompt = [e for e in leader if isinstance(e, PromptLogprob)]
        own = [e for e in entries if not isinstance(e, PromptLogprob)] if keep else []
        found = token_text.echoed(echo.first, prompt, own, len(echo.text))
        if own:
            self.text_offset = found["text_offset"][-1] + len(found["tokens"][-1])
        return whole, found

    def commit_chunk(self, text: str, forwards: int, tokens: int) -> str:
        """A text chunk that also says how many forwards committed it (stream_commits)."""
        extra = f',"wedlm":{{"forwards":{forwards},"tokens":{tokens}}}}}\n\n'
        return self.text_chunk(text).removesuffix("}\n\n") + extra

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": self.index, "delta": delta, "finish_reason": finish,
                      "logprobs": None}  # fmt: skip
            return _sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": self.index, "text": text or "", "finish_reason": finish,
                  "logprobs": None}  # fmt: skip
        return _sse(self._envelope("text_completion", [choice]))

    def usage_chunk(self, usage: dict[str, int]) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse(self._envelope(obj, [], usage=usage))

    def reasoning_chunk(self, text: str, logprobs: dict[str, Any] | None = None) -> str:
        """Reasoning text, under both names clients read (mlx-lm's and vLLM's
        `reasoning`, DeepSeek's `reasoning_content`)."""
        delta = {"reasoning": text, "reasoning_content": text}
        choice = {"index": self.index, "delta": delta, "finish_reason": None,
                  "logprobs": logprobs}  # fmt: skip
        return _sse(self._envelope("chat.completion.chunk", [choice]))

    def calls_chunk(self, calls: list[dict[str, Any]]) -> str:
        """Tool calls, each whole in one delta (sent once its end marker arrived)."""
        deltas = []
        for call in calls:
            deltas.append({"index": self.call_index, **call})
            self.call_index += 1
        choice = {"index": self.index, "delta": {"tool_calls": deltas}, "finish_reason": None,
                  "logprobs": None}  # fmt: skip
        return _sse(self._envelope("chat.completion.chunk", [choice]))

    def whole(
        self,
        text: str,
        finish: str,
        usage: dict[str, int],
        calls: list | None = None,
        logprobs: dict[str, Any] | None = None,
        reasoning: str = "",
    ) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
            if calls:
                message["content"] = text or None
                message["tool_calls"] = calls
            choice = {"index": self.index, "message": message, "finish_reason": finish,
                      "logprobs": logprobs}  # fmt: skip
            return self._envelope("chat.completion", [choice], usage=usage)
        choice = {"index": self.index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return self._envelope("text_completion", [choice], usage=usage)


def _usage(result: RequestResult) -> dict[str, Any]:
    prompt, completion = result.prompt_tokens, len(result.tokens)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}  # fmt: skip
    # OpenAI's field for prompt tokens served from a cache
    usage["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    if result.mode:  # beyond OpenAI's fields: the decoding that ran, and its caveat
        usage["mode"] = result.mode
    usage["forwards"] = result.forwards  # forwards that committed its tokens
    if result.warning:
        usage["warning"] = result.warning
    drafted = result.drafted_tokens
    if drafted:  # speculative mode: OpenAI's fields for verified predictions
        accepted = result.accepted_drafts
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return usage


def _usage_of(results: list[RequestResult]) -> dict[str, Any]:
    """Usage of n choices: the prompt once (as OpenAI counts it), the completions' tokens
    and forwards summed."""
    usage = _usage(results[0])
    for result in results[1:]:
        more = _usage(result)
        usage["completion_tokens"] += more["completion_tokens"]
        usage["total_tokens"] += more["completion_tokens"]
        usage["forwards"] += more["forwards"]
    return usage


def _usage_all(results: list[RequestResult], n: int, echo_only: bool) -> dict[str, Any]:
    """Usage of a request's prompts (n choices each, in order): each prompt counted once,
    everything summed; echo only (max_tokens 0) answers no completion tokens."""
    usage = _usage_of(results[:n])
    for start in range(n, len(results), n):
        more = _usage_of(results[start : start + n])
        for key in ("prompt_tokens", "completion_tokens", "total_tokens", "forwards"):
            usage[key] += more[key]
        usage["prompt_tokens_details"]["cached_tokens"] += more["prompt_tokens_details"][
            "cached_tokens"
        ]
        if "completion_tokens_details" in more:
            details = usage.setdefault("completion_tokens_details", {
                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0})  # fmt: skip
            for key, value in more["completion_tokens_details"].items():
                details[key] += value
    if echo_only:
        usage["total_tokens"] -= usage["completion_tokens"]
        usage["completion_tokens"] = 0
    return usage


async def _merged(streams: list) -> AsyncIterator[Any]:
    """The items of several async iterators as each comes (one alone: as it is)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(stream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:  # the client went away, or a choice failed: stop the others
            task.cancel()


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
    token_text = LogprobText(backend.tokenizer)

    async def authorized(authorization: str | None = Header(default=None)) -> None:
        if not backend.key_matches(authorization):
            problem = "Incorrect API key provided" if authorization else "Missing API key"
            raise ApiError(401, f"{problem} (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")  # fmt: skip

    def check_model(name: str) -> None:
        if name != backend.model_name:
            raise ApiError(404, f"The model {name!r} does not exist: this server serves "
                           f"{backend.model_name!r}", "model", "model_not_found")  # fmt: skip

    async def start(request: Request, body: GenerationFields) -> list[Generation]:
        """The request's choices (n > 1: seeds seed, seed + 1, ..., one prompt prefill)."""
        check_model(body.model)
        encode = openai_encoder(backend, body)
        try:
            return await Generation.start_choices(backend, request, encode, body.n or 1)
        except Refused as e:
            raise from_refusal(e, body.limit_field(), PARAM_FIELDS, body.prompt_field()) from None

    async def start_prompts(
        request: Request, body: CompletionRequest
    ) -> tuple[list[Generation], list[_Echo | None]]:
        """Completions: n choices per prompt (a list of prompts: all admitted at once, so
        the engine batches them; one refused cancels the others), and per prompt what
        `echo` answers first (None without echo)."""
        check_model(body.model)
        vocab = backend.admission.engine.config.vocab_size
        prompts = await run_in_threadpool(
            completion_prompts, body, backend.tokenizer, backend.context, vocab
        )
        n = body.n or 1
        started = await asyncio.gather(
            *(Generation.start_choices(backend, request, openai_encoder(backend, body, ids), n)
              for ids in prompts),
            return_exceptions=True,
        )  # fmt: skip
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:
            for choices in started:
                for gen in choices if isinstance(choices, list) else ():
                    gen.cancel()
            if isinstance(failed[0], Refused):
                field = body.prompt_field()
                raise from_refusal(failed[0], body.limit_field(), PARAM_FIELDS, field) from None
            raise failed[0]
        echoes: list[_Echo | None] = [None] * len(prompts)
        if body.echo:
            texts = body.prompts()
            for i, ids in enumerate(prompts):
                text = texts[i] if isinstance(texts[i], str) else backend.tokenizer.decode(ids)
                echoes[i] = _Echo(text, ids[0], body.echo_only())  # type: ignore[arg-type]
        return [g for choices in started for g in choices], echoes  # type: ignore[union-attr]

    async def answer(request: Request, body: GenerationFields, chat: bool):
        if isinstance(body, CompletionRequest):
            gens, echoes = await start_prompts(request, body)
        else:
            gens, echoes = await start(request, body), [None]
        n = len(gens) // len(echoes)  # choices per prompt, in order (OpenAI's indices)
        replies = [_Reply(chat, backend.model_name, echo=echoes[0])]
        replies += [_Reply(chat, backend.model_name, i, replies[0], echoes[i // n])
                    for i in range(1, len(gens))]  # fmt: skip
        # the answer's parts (content, reasoning, calls) in the model's own format
        tools = chat_tools(body) if chat else None  # type: ignore[arg-type]
        parsed = chat and (tools is not None or has_reasoning(backend.tokenizer))
        logprobs = gens[0].job.params.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            streams = [_choice_stream(g, r, tools if parsed else False, body.stream_commits,
                                      logprobs)
                       for g, r in zip(gens, replies, strict=True)]  # fmt: skip
            return event_stream(_stream(streams, replies, include_usage, n))
        results = await asyncio.gather(*(g.result() for g in gens))
        if any(r is None for r in results):
            return JSONResponse(error_body(499, "the client disconnected"), 499)
        for result in results:
            if result.error:
                raise failure(result)
        answers = []
        for i, (gen, reply, result) in enumerate(zip(gens, replies, results, strict=True)):
            text, reasoning, calls = result.text, "", []
            if parsed:
                text, reasoning, calls = split_answer(backend.tokenizer, text, tools,
                                                      gen.job.prompt)  # fmt: skip
            reason = finish_reason(result)
            if calls and reason == "stop":
                reason = "tool_calls"
            found = None
            if reply.echo is not None:  # its prompt's logprobs: the prompt's first choice's
                leader = gens[i - i % n].job.logprobs
                text, found = reply.echoed(text, gen.job.logprobs, leader, token_text, logprobs)
            elif logprobs:
                found = reply.logprobs(gen.job.logprobs, token_text)
            answers.append(reply.whole(text, reason, _usage(result), calls, found, reasoning))
        whole = answers[0]
        whole["choices"] = [a["choices"][0] for a in answers]
        whole["usage"] = _usage_all(results, n, echoes[0] is not None and echoes[0].drop)
        return JSONResponse(whole)

    async def _stream(streams: list, replies: list[_Reply], include_usage: bool, n: int):
        """The choices' chunks as they come (interleaved when n > 1 or several prompts),
        then the usage of all and [DONE]. Each choice stream yields SSE text, then its
        (index, result) record."""
        if replies[0].chat:
            for reply in replies:
                yield reply.chunk(None, role=True)
        results = []
        async for item in _merged(streams):
            if isinstance(item, str):
                yield item
                continue
            results.append(item)
            if item[1].error:
                break
        complete = len(results) == len(streams) and not any(r.error for _, r in results)
        if complete and include_usage:
            drop = replies[0].echo is not None and replies[0].echo.drop
            ordered = [r for _, r in sorted(results, key=lambda item: item[0])]
            yield replies[0].usage_chunk(_usage_all(ordered, n, drop))
        yield "data: [DONE]\n\n"

    async def _choice_stream(gen: Generation, reply: _Reply, tools, commits: bool, logprobs: bool):
        """One choice's chunks, then its (index, result) record. `commits` (stream_commits):
        a chunk per commit, saying how many forwards and tokens it carries (the console
        groups the tokens of one forward); `logprobs`: each text chunk carries its tokens'
        logprobs. With echo, the prompt's chunk comes first (with its logprobs, which the
        first commit carried)."""
        # `tools` False: the answer is not parsed (plain text); else the request's tools.
        # The console's per-commit stream without tools shows the raw answer, as before.
        calls = None
        if tools is not False and not (commits and tools is None):
            calls = reply_stream(backend.tokenizer, tools, gen.job.prompt)
        echo = reply.echo
        held: list = []  # logprobs of committed tokens whose text the parser holds back

        def chunks(pieces):  # text, reasoning, or the calls of one completed tool call
            for p in pieces:
                if isinstance(p, list):
                    yield reply.calls_chunk(p)
                    continue
                found = reply.logprobs(held, token_text) if logprobs else None
                held.clear()
                if isinstance(p, Reasoning):
                    yield reply.reasoning_chunk(p, found)
                else:
                    yield reply.text_chunk(p, found)

        async for piece in gen.pieces(merge=not commits):
            if echo is not None and not (isinstance(piece, RequestResult) and piece.error):
                text, found = reply.echoed("", gen.job.logprobs, gen.job.logprobs, token_text,
                                           logprobs, answer=False)  # fmt: skip
                yield reply.text_chunk(text, found)
                echo = None
            if isinstance(piece, str):
                if reply.echo is not None and reply.echo.drop:
                    continue  # echo only: the one token decoded is not answered
                if calls is None and isinstance(piece, CommitText) and logprobs:
                    own = [e for e in piece.logprobs if not isinstance(e, PromptLogprob)]
                    yield reply.text_chunk(piece, reply.logprobs(own, token_text))
                elif calls is None and isinstance(piece, CommitText) and commits:
                    yield reply.commit_chunk(piece, piece.forwards, piece.tokens)
                elif calls is None:
                    yield reply.text_chunk(piece)
                else:
                    if isinstance(piece, CommitText) and logprobs:
                        held.extend(e for e in piece.logprobs if not isinstance(e, PromptLogprob))
                    for chunk in chunks(calls.add(piece)):
                        yield chunk
                continue
            result = piece
            if result.error:
                fail = failure(result)
                yield _sse(error_body(fail.status, fail.message, code=fail.code, kind=fail.kind))
            else:
                reason = finish_reason(result)
                if calls is not None:
                    for chunk in chunks(calls.finish()):
                        yield chunk
                    if held and logprobs:  # a call's tokens, or text the parser dropped
                        yield reply.text_chunk("", reply.logprobs(held, token_text))
                    if calls.calls and reason == "stop":
                        reason = "tool_calls"
                yield reply.chunk(None, finish=reason)
            yield reply.index, result

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
        return await answer(request, body, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest, parsing)
        return await answer(request, body, chat=False)

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
