"""The OpenAI completions' answers, chat (`/v1/chat/completions`) and text
(`/v1/completions`): the request's choices (n per prompt, several prompts) admitted
together, then answered as one JSON body or streamed (openai_stream.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.api_errors import error_body, from_refusal
from coordinator.http_api.generation import (
    Generation,
    event_stream,
    failure,
    finish_reason,
    openai_encoder,
)
from coordinator.http_api.logprobs_format import LogprobText
from coordinator.http_api.openai_reply import ChoiceReply, Echo
from coordinator.http_api.openai_stream import choice_stream, sse_stream
from coordinator.http_api.openai_usage import choice_usage, request_usage
from coordinator.http_api.reply_parsing import has_reasoning, split_answer
from coordinator.http_api.request_mapping import PARAM_FIELDS, chat_tools, completion_prompts
from coordinator.http_api.schemas import CompletionRequest, GenerationFields
from coordinator.service.admission import Refused


class OpenAiCompletions:
    """Answers the completions routes over one backend; `check_model` refuses a request
    for a model this server does not serve."""

    def __init__(self, backend: ApiBackend, check_model: Callable[[str], None]) -> None:
        self.backend = backend
        self.check_model = check_model
        self.token_text = LogprobText(backend.tokenizer)

    async def start(self, request: Request, body: GenerationFields) -> list[Generation]:
        """The request's choices (n > 1: seeds seed, seed + 1, ..., one prompt prefill)."""
        backend = self.backend
        self.check_model(body.model)
        encode = openai_encoder(backend, body)
        try:
            return await Generation.start_choices(backend, request, encode, body.n or 1)
        except Refused as e:
            raise from_refusal(e, body.limit_field(), PARAM_FIELDS, body.prompt_field()) from None

    async def start_prompts(
        self, request: Request, body: CompletionRequest
    ) -> tuple[list[Generation], list[Echo | None]]:
        """Completions: n choices per prompt (a list of prompts: all admitted at once, so
        the engine batches them; one refused cancels the others), and per prompt what
        `echo` answers first (None without echo)."""
        backend = self.backend
        self.check_model(body.model)
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
        echoes: list[Echo | None] = [None] * len(prompts)
        if body.echo:
            texts = body.prompts()
            for i, ids in enumerate(prompts):
                text = texts[i] if isinstance(texts[i], str) else backend.tokenizer.decode(ids)
                echoes[i] = Echo(text, ids[0], body.echo_only())  # type: ignore[arg-type]
        return [g for choices in started for g in choices], echoes  # type: ignore[union-attr]

    async def answer(self, request: Request, body: GenerationFields, chat: bool):
        backend, token_text = self.backend, self.token_text
        if isinstance(body, CompletionRequest):
            gens, echoes = await self.start_prompts(request, body)
        else:
            gens, echoes = await self.start(request, body), [None]
        n = len(gens) // len(echoes)  # choices per prompt, in order (OpenAI's indices)
        replies = [ChoiceReply(chat, backend.model_name, echo=echoes[0])]
        replies += [ChoiceReply(chat, backend.model_name, i, replies[0], echoes[i // n])
                    for i in range(1, len(gens))]  # fmt: skip
        # the answer's parts (content, reasoning, calls) in the model's own format
        tools = chat_tools(body) if chat else None  # type: ignore[arg-type]
        parsed = chat and (tools is not None or has_reasoning(backend.tokenizer))
        logprobs = gens[0].job.params.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            answer_tools = tools if parsed else False  # False: the text is not parsed
            streams = [choice_stream(backend.tokenizer, token_text, g, r, answer_tools,
                                     body.stream_commits, logprobs)
                       for g, r in zip(gens, replies, strict=True)]  # fmt: skip
            return event_stream(sse_stream(streams, replies, include_usage, n))
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
            answers.append(reply.whole(text, reason, choice_usage(result), calls, found, reasoning))
        whole = answers[0]
        whole["choices"] = [a["choices"][0] for a in answers]
        whole["usage"] = request_usage(results, n, echoes[0] is not None and echoes[0].drop)
        return JSONResponse(whole)
