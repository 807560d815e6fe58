"""The closed loops' clients: one request over gRPC (WedlmClient) or over an
OpenAI-compatible HTTP API (the official `openai` package), recorded into a Rec, and the
loop that sends them one after another. Any failure is a failed request, never a dead
client."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.generation_params import GenerationParams
from wedlm_client.bench.records import PROMPTS, Rec, Schedule, now
from wedlm_client.client import ClusterError, WedlmClient, final_dict

REFUSAL_PAUSE_S = 0.05  # do not spin on a refusal or a closed port
# after cancelling what still runs at the deadline: how long its threads may take to unwind
# (an HTTP request still waiting for its response's headers times out this soon after)
UNWIND_S = 2.0


def stream_request(client: WedlmClient, text: str, params: GenerationParams, rec: Rec) -> bool:
    """Fills `rec` (not its end time); False when the request failed."""
    try:
        for event in client.generate_stream(text=text, params=params):
            if event[0] == "tokens":
                rec.events.append((now(), len(event[1])))
            else:
                rec.final = event[1]
                rec.error = "FINAL_ERROR" if event[1].get("error") else None
                rec.detail = event[1].get("error")
    except ClusterError as e:
        rec.error, rec.detail = e.code.name, str(e)[:300]
        return False
    except Exception as e:  # a broken stream: a failure like any other
        rec.error, rec.detail = type(e).__name__, str(e)[:300]
        return False
    return rec.error is None


def wait_request(client: WedlmClient, text: str, params: GenerationParams, rec: Rec) -> bool:
    """The same request without a stream: Submit, then WaitJob until it ends (the
    coordinator wakes no thread of this request per commit). Its tokens count as one
    event at the end."""
    try:
        job_id = client.submit(text=text, params=params)
        while True:
            job = client.wait_job(job_id, timeout_s=30.0)
            if job.HasField("result"):
                break
    except ClusterError as e:
        rec.error = e.code.name
        return False
    final = final_dict(job.result)
    rec.events.append((now(), len(final["tokens"])))
    rec.final = final
    rec.error = "FINAL_ERROR" if final.get("error") else None
    return True


@dataclass(frozen=True)
class OpenAIRequest:
    """What each request of an `openai` closed loop asks for. `extra`: extra body fields (the
    WeDLM ones; None sends plain OpenAI requests); `tag`: when set, every prompt starts with
    `w<tag> w<k>` (k: the request's number in the level), so that no two requests of a run,
    nor of two runs with different tags, share a prefix (a prefix cache then reuses nothing).
    Words of that form are in the vocabulary of benchmarks/dev/cluster.py's random
    checkpoints, whose word-level tokenizer maps every other word to one id."""

    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    extra: dict | None = None
    tag: int | None = None

    def prompt(self, k: int) -> str:
        text = PROMPTS[k % len(PROMPTS)]
        return text if self.tag is None else f"w{self.tag} w{k} {text}"


def _read_timeout(deadline: float | None):
    """The per-request timeout: with a deadline, no read waits past it (a server that has
    not even sent its response's headers by then lets go), else the client's own."""
    if deadline is None:
        return None
    import httpx

    return httpx.Timeout(600.0, read=max(deadline - now(), 0.0) + UNWIND_S / 2)


def _stream_abort(stream) -> Callable[[], None]:
    """How to end a response stream from another thread: shut its socket down, which wakes
    the thread blocked reading it (closing it would not) and tells the server we left."""
    network = stream.response.extensions.get("network_stream")
    sock = network.get_extra_info("socket") if network is not None else None

    def abort() -> None:
        if sock is None:
            stream.close()
            return
        with contextlib.suppress(OSError):  # socket.socket's own: an SSL socket's keeps TLS
            socket.socket.shutdown(sock, socket.SHUT_RDWR)

    return abort


def openai_request(client, model: str, req: OpenAIRequest, k: int, rec: Rec,
                   deadline: float | None = None) -> bool:  # fmt: skip
    """One streamed completion. Per request: a (time, 1) event per chunk with text, the final
    usage's completion tokens (or, when no usage chunk comes, the count of chunks with
    text), any exception as the error, and a finish reason other than stop or length as
    one too. `deadline`: when the run may cut it (rec.cancel then aborts its stream)."""
    tokens, finish = None, None
    timeout = _read_timeout(deadline)
    try:
        stream = client.completions.create(
            model=model,
            prompt=req.prompt(k),
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            stream=True,
            stream_options={"include_usage": True},
            **({} if req.seed is None else {"seed": req.seed}),
            **({} if req.extra is None else {"extra_body": req.extra}),
            **({} if timeout is None else {"timeout": timeout}),
        )
        rec.cancel = _stream_abort(stream)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                rec.events.append((now(), 1))
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if tokens is None and not rec.events:
            rec.error = "EmptyStream"  # neither text nor usage: nothing was served
        elif finish not in (None, "stop", "length"):
            rec.error = f"finish_reason={finish}"  # e.g. abort: the server gave up
    except Exception as e:
        status = getattr(e, "status_code", None)
        rec.error = type(e).__name__ + (f" {status}" if status else "")
        rec.detail = str(e)[:300]
    if rec.error is not None:
        return False
    n = len(rec.events) if tokens is None else tokens
    if rec.events and n > len(rec.events):  # tokens that made no text of their own
        t, c = rec.events[-1]
        rec.events[-1] = (t, c + n - len(rec.events))  # so TPOT counts every token
    rec.final = {"tokens": [0] * n}
    return True


def openai_thread(base_url: str, model: str, req: OpenAIRequest, schedule, recs: list[Rec],
                  first: int, step: int) -> None:  # fmt: skip
    """One closed loop of streaming completions through the official `openai` package."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    deadline = schedule.deadline
    with client:
        _loop(lambda k, rec: openai_request(client, model, req, k, rec, deadline), schedule,
              recs, first, step)  # fmt: skip


def grpc_thread(address: str, params, schedule: Schedule, recs: list[Rec], first: int, step: int,
                request=stream_request, prompts=PROMPTS) -> None:  # fmt: skip
    """One closed loop of gRPC requests (`request`: stream_request or wait_request)."""
    with WedlmClient(address) as client:
        # closing the channel ends its calls at once, from any thread: a cut stream's abort
        _loop(lambda k, rec: request(client, prompts[k % len(prompts)], params, rec),
              schedule, recs, first, step, client.close)  # fmt: skip


def _loop(send, schedule: Schedule, recs: list[Rec], first: int, step: int,
          cancel: Callable[[], None] | None = None) -> None:  # fmt: skip
    for k in itertools.count(first, step):
        if (rec := schedule.next()) is None:
            return
        rec.cancel = cancel  # `send` may set a finer one
        ok = send(k, rec)
        rec.end = now()
        if not schedule.close(rec, recs):
            return  # cut at the deadline: Schedule.cut has its record
        if not ok:
            time.sleep(REFUSAL_PAUSE_S)


def http_thread(base_url: str, model: str, params, schedule, recs: list[Rec], first, step):
    """The `openai` loop with the WeDLM fields of `params` (GenerationParams)."""
    extra = {
        "mode": params.mode,
        "window": params.window,
        "threshold": params.threshold,
        "penalty": params.penalty,
    }
    req = OpenAIRequest(params.max_tokens, params.temperature, params.seed, extra)
    openai_thread(base_url, model, req, schedule, recs, first, step)


THREADS = {"grpc": grpc_thread, "http": http_thread, "openai": openai_thread}


def ready() -> bool:
    """Run once in each client process, before the clock starts."""
    with contextlib.suppress(ImportError):  # only HTTP targets need it; they say so
        import openai  # noqa: F401
    return True


def client_part(kind, target, model, params, threads, first, step, start, duration, warmup,
                requests=0) -> list[Rec]:  # fmt: skip
    """One client process: `threads` closed loops from `start` on; returns their records.
    With a duration, what still runs at the schedule's deadline is cancelled and returned
    as unfinished: a slow server cannot stretch the run."""
    time.sleep(max(start - now(), 0.0))
    schedule = Schedule(duration, requests, warmup)
    recs: list[Rec] = []
    run = THREADS[kind]
    args = (target, params) if kind == "grpc" else (target, model, params)
    # daemons: a request that would not let go cannot keep this process from exiting
    pool = [
        threading.Thread(
            target=run, args=(*args, schedule, recs, first + i * step, step * threads), daemon=True
        )
        for i in range(threads)
    ]
    for t in pool:
        t.start()
    _join(pool, schedule.deadline)
    cut = schedule.cut()  # nothing joins `recs` after this
    _join(pool, now() + UNWIND_S)  # their connections close before the next run starts
    return [*recs, *cut]


def _join(threads: list[threading.Thread], until: float | None) -> None:
    for t in threads:
        t.join(None if until is None else max(until - now(), 0.0))
