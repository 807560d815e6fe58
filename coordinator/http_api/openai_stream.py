"""An OpenAI answer streamed as server-sent events: each choice's chunks as it commits
(text, reasoning, tool calls, logprobs), the choices interleaved as they come, then the
usage of all and [DONE]."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from common.tokenizer import Tokenizer
from coordinator.engine.token_logprobs import PromptLogprob
from coordinator.http_api.api_errors import error_body
from coordinator.http_api.generation import CommitText, Generation, failure, finish_reason
from coordinator.http_api.logprobs_format import LogprobText
from coordinator.http_api.openai_reply import ChoiceReply, sse
from coordinator.http_api.openai_usage import request_usage
from coordinator.http_api.reply_parsing import Reasoning, reply_stream
from coordinator.service.messages import RequestResult


async def merged(streams: list) -> AsyncIterator[Any]:
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


async def sse_stream(
    streams: list, replies: list[ChoiceReply], include_usage: bool, n: int
) -> AsyncIterator[str]:
    """The choices' chunks as they come (interleaved when n > 1 or several prompts),
    then the usage of all and [DONE]. Each choice stream yields SSE text, then its
    (index, result) record."""
    if replies[0].chat:
        for reply in replies:
            yield reply.chunk(None, role=True)
    results = []
    async for item in merged(streams):
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
        yield replies[0].usage_chunk(request_usage(ordered, n, drop))
    yield "data: [DONE]\n\n"


async def choice_stream(
    tokenizer: Tokenizer,
    token_text: LogprobText,
    gen: Generation,
    reply: ChoiceReply,
    tools,
    commits: bool,
    logprobs: bool,
) -> AsyncIterator[Any]:
    """One choice's chunks, then its (index, result) record. `commits` (stream_commits):
    a chunk per commit, saying how many forwards and tokens it carries (the console
    groups the tokens of one forward); `logprobs`: each text chunk carries its tokens'
    logprobs. With echo, the prompt's chunk comes first (with its logprobs, which the
    first commit carried)."""
    # `tools` False: the answer is not parsed (plain text); else the request's tools.
    # The console's per-commit stream without tools shows the raw answer, as before.
    calls = None
    if tools is not False and not (commits and tools is None):
        calls = reply_stream(tokenizer, tools, gen.job.prompt)
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
            yield sse(error_body(fail.status, fail.message, code=fail.code, kind=fail.kind))
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
