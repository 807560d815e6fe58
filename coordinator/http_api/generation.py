"""One generation request on the HTTP side, shared by every API (OpenAI, Anthropic,
Ollama, Responses): admission on a worker thread, the engine's events handed to the event
loop, stop strings trimmed, and the job cancelled (its KV freed) when the client goes
away. An API only turns a request into (prompt ids, GenerationParams) and the pieces
into its own chunks, events and errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from common.generation_params import GenerationParams
from common.modes import Mode
from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import ApiError
from coordinator.http_api.job_events import JobEvents
from coordinator.http_api.request_mapping import (
    chat_prompt,
    chat_tools,
    completion_prompt,
    generation_params,
)
from coordinator.http_api.response_format import response_format_grammar, tool_choice_grammar
from coordinator.http_api.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from coordinator.http_api.stop_text import StopText, trim_at_stop
from coordinator.service.jobs import Job
from coordinator.service.messages import Final, RequestResult, Tokens
from coordinator.service.results import ENGINE_STOPPED, OUT_OF_MEMORY

Encode = Callable[[], tuple[list[int], GenerationParams]]


def openai_encoder(
    backend: ApiBackend, body: GenerationFields, ids: list[int] | None = None
) -> Encode:
    """The prompt ids and GenerationParams of an OpenAI request, chat or text, as every
    API adapter maps its own request into one (run by Generation.start on a worker thread).
    `ids`: a completion prompt already tokenized (one of a request's list of prompts)."""

    def encode() -> tuple[list[int], GenerationParams]:
        if ids is not None:
            prompt = ids
        elif isinstance(body, ChatCompletionRequest):
            prompt = chat_prompt(body, backend.tokenizer, backend.context)
        else:
            prompt = completion_prompt(body, backend.tokenizer, backend.context)  # type: ignore[arg-type]
        vocab = backend.admission.engine.config.vocab_size
        params = generation_params(
            body, len(prompt), backend.context, backend.default_max_tokens, vocab
        )
        if isinstance(body, CompletionRequest) and body.echo:
            params = echo_params(body, params, backend.default_mode)
        if isinstance(body, ChatCompletionRequest):
            grammars = backend.admission.engine.grammars
            grammar = response_format_grammar(body.response_format, grammars)
            if body.tools_in_use() and backend.tokenizer.tool_calling is not None:
                tools = chat_tools(body) or []
                syntax = backend.tokenizer.tool_calling
                grammar = tool_choice_grammar(body.tool_choice, tools, syntax, grammars) or grammar
            params = replace(params, grammar=grammar)
        return prompt, params

    return encode


def echo_params(
    body: CompletionRequest, params: GenerationParams, default_mode: str
) -> GenerationParams:
    """Completions' echo: with logprobs, the prompt's too. Echo only (max_tokens 0) decodes
    the one token it drops autoregressively where it can: AR takes it from the prompt's
    last row, so no forward is spent past the prompt's."""
    params = replace(params, prompt_logprobs=params.logprobs is not None)
    if body.echo_only() and Mode.DIFFUSION not in (params.mode, default_mode):
        params = replace(params, mode=Mode.AR)
    return params


class CommitText(str):
    """Text of committed tokens, with the forwards (commits) and tokens it carries, and
    those tokens' logprobs (TokenLogprob each; empty unless the request asks)."""

    forwards: int
    tokens: int
    logprobs: list

    def __new__(cls, text: str, forwards: int, tokens: int, logprobs: list = ()) -> CommitText:
        piece = super().__new__(cls, text)
        piece.forwards, piece.tokens, piece.logprobs = forwards, tokens, list(logprobs)
        return piece


class Generation:
    def __init__(self, backend: ApiBackend, request: Request, job: Job, events: JobEvents):
        self.backend, self.request, self.job, self.events = backend, request, job, events
        self.stops = job.params.stop_strings

    @classmethod
    async def start(cls, backend: ApiBackend, request: Request, encode: Encode) -> Generation:
        """`encode` runs on a worker thread (a chat template and tokenization can take
        milliseconds, and admission may write the job to the store); it raises the API's
        own errors, admission raises Refused (each API words it)."""
        return (await cls.start_choices(backend, request, encode, 1))[0]

    @classmethod
    async def start_choices(
        cls, backend: ApiBackend, request: Request, encode: Encode, n: int
    ) -> list[Generation]:
        """`n` choices of one request, as `start`: choice i samples with seed + i, and the
        prompt is encoded once and prefilled once (the choices share its KV rows)."""
        loop = asyncio.get_running_loop()
        events = [JobEvents(loop) for _ in range(n)]

        def admit() -> list[Job]:
            prompt, params = encode()
            # the prompt's logprobs are the same for every choice: the first computes them
            # (the others copy its prompt rows, prompt_sharing.py)
            choices = [
                replace(
                    params,
                    seed=(params.seed + i) % 2**32,
                    prompt_logprobs=params.prompt_logprobs and i == 0,
                )
                for i in range(n)
            ]
            listens = [e.put for e in events]
            return backend.admission.accept_choices(prompt, choices, 0.0, listens)

        jobs = await run_in_threadpool(admit)
        return [cls(backend, request, job, e) for job, e in zip(jobs, events, strict=True)]

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.prompt)

    def cancel(self) -> None:
        if not self.job.finished:  # the client went away (or the server stops): free its KV
            self.backend.admission.cancel(self.job)

    async def pieces(self, merge: bool = True) -> AsyncIterator[str | RequestResult]:
        """The answer's text as it commits (stop strings left out; CommitText pieces,
        each one commit when not `merge`d), then the final result (its text trimmed
        the same way). Ends without a result when the client disconnected; the
        job is cancelled then."""
        trimmer = StopText(self.stops)
        forwards = tokens = 0  # committed since the last piece
        logprobs: list = []  # of those tokens (a piece held back keeps them)
        try:
            while (event := await self.events.next(self.request, merge)) is not None:
                match event:
                    case Tokens():
                        forwards, tokens = forwards + event.commits, tokens + len(event.ids)
                        logprobs += event.logprobs or ()
                        if text := trimmer.add(event.text):
                            yield CommitText(text, forwards, tokens, logprobs)
                            forwards = tokens = 0
                            logprobs = []
                    case Final(result=RequestResult(error="") as result):
                        if tail := trimmer.finish():
                            yield CommitText(tail, forwards, tokens, logprobs)
                        yield self._trimmed(result)
                        return
                    case Final(result=result):  # failed
                        yield result
                        return
        finally:
            self.cancel()

    def _trimmed(self, result: RequestResult) -> RequestResult:
        """The result with its text cut at a stop string, and which one (stop_sequence:
        None when none ended it)."""
        text = trim_at_stop(result.text, self.stops)
        found = [s for s in self.stops if result.text.startswith(s, len(text))]
        return replace(result, text=text, stop_sequence=found[0] if found else None)

    async def result(self) -> RequestResult | None:
        """The final result (text trimmed at a stop string), or None when the
        client disconnected first."""
        try:
            while (event := await self.events.next(self.request)) is not None:
                if isinstance(event, Final):
                    result = event.result
                    return result if result.error else self._trimmed(result)
            return None
        finally:
            self.cancel()


def failure(result: RequestResult) -> ApiError:
    """A failed generation: out of memory is a 503 server_error (retry later, or ask
    for less), a stopped engine a 503 (the server cannot decode), anything else a 500."""
    if result.error_kind == OUT_OF_MEMORY:
        return ApiError(503, result.error, code="out_of_memory", kind="server_error")
    if result.error_kind == ENGINE_STOPPED:
        return ApiError(503, result.error, code="engine_stopped")
    return ApiError(500, f"generation failed: {result.error}", code="generation_failed")


def finish_reason(result: RequestResult) -> str:
    """ "stop" (EOS, a stop id or string), "length" (the limit or the context), or "abort"
    (cancelled, expired)."""
    return {"stop": "stop", "length": "length"}.get(result.finish_reason or "", "abort")


def event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events, unbuffered by proxies (every API's streamed answer)."""
    return StreamingResponse(
        chunks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
