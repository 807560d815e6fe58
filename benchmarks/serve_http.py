"""The HTTP phase of benchmarks/serve.py: the same closed loop over the OpenAI-compatible
HTTP API (the official `openai` package, streaming /v1/completions with usage) and over
gRPC (WedlmClient), on one coordinator, level by level and side by side, the order of
the two swapped every round. The clients run in several processes, so that the load
generator's own Python (the `openai` package parses every chunk with pydantic) is not
what is measured.

tok/s here counts the completion tokens of requests that finished inside the measured
window, for both sides alike (an HTTP chunk does not say how many tokens it carries);
TTFT is the first chunk with text (HTTP) or the first token event (gRPC).
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import numpy as np

from benchmarks.serve_mlxlm import PROMPTS, Rec, Schedule, now, summarize

START_DELAY_S = 2.0  # every client process starts its schedule at the same moment


def _ready() -> bool:
    import openai  # noqa: F401  (imported once per process, before the clock starts)

    return True


def _grpc_thread(address: str, params, schedule: Schedule, recs: list[Rec], first: int, step: int):
    from benchmarks.grpc_request import stream_request
    from wedlm_client.client import WedlmClient

    with WedlmClient(address) as client:
        for k in itertools.count(first, step):
            if (rec := schedule.next()) is None:
                return
            if not stream_request(client, PROMPTS[k % len(PROMPTS)], params, rec):
                time.sleep(0.05)
            rec.end = now()
            recs.append(rec)


@dataclass(frozen=True)
class OpenAIRequest:
    """What each request of an `openai` closed loop asks for. `extra`: extra body fields (the
    WeDLM ones; None sends plain OpenAI requests); `tag`: when set, every prompt starts with
    `w<tag> w<k>` (k: the request's number in the level), so that no two requests of a run,
    nor of two runs with different tags, share a prefix (a prefix cache then reuses nothing).
    Words of that form are in the vocabulary of benchmarks/cluster.py's random checkpoints,
    whose word-level tokenizer maps every other word to one id."""

    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    extra: dict | None = None
    tag: int | None = None

    def prompt(self, k: int) -> str:
        text = PROMPTS[k % len(PROMPTS)]
        return text if self.tag is None else f"w{self.tag} w{k} {text}"


def openai_thread(base_url: str, model: str, req: OpenAIRequest, schedule, recs: list[Rec],
                  first: int, step: int) -> None:  # fmt: skip
    """One closed loop of streaming completions through the official `openai` package. Per
    request: a (time, 1) event per chunk with text, the final usage's completion tokens (or,
    when no usage chunk comes, the count of chunks with text), any exception as the error,
    and a finish reason other than stop or length as one too."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    with client:
        for k in itertools.count(first, step):
            if (rec := schedule.next()) is None:
                return
            tokens, finish = None, None
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
                )
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
            except Exception as e:  # any failure is a failed request, not a dead client
                status = getattr(e, "status_code", None)
                rec.error = type(e).__name__ + (f" {status}" if status else "")
                rec.detail = str(e)[:300]
            if rec.error is None:
                n = len(rec.events) if tokens is None else tokens
                if rec.events and n > len(rec.events):  # tokens that made no text of their own
                    t, c = rec.events[-1]
                    rec.events[-1] = (t, c + n - len(rec.events))  # so TPOT counts every token
                rec.final = {"tokens": [0] * n}
            else:
                time.sleep(0.05)  # do not spin on a refusal
            rec.end = now()
            recs.append(rec)


def _http_thread(base_url: str, model: str, params, schedule, recs: list[Rec], first, step):
    """The `openai` loop with the WeDLM fields of `params` (GenerationParams)."""
    extra = {
        "mode": params.mode,
        "window": params.window,
        "threshold": params.threshold,
        "penalty": params.penalty,
    }
    req = OpenAIRequest(params.max_tokens, params.temperature, params.seed, extra)
    openai_thread(base_url, model, req, schedule, recs, first, step)


THREADS = {"grpc": _grpc_thread, "http": _http_thread, "openai": openai_thread}


def _client_part(kind, target, model, params, threads, first, step, start, duration, warmup):
    """One client process: `threads` closed loops; returns their records."""
    import threading

    time.sleep(max(start - now(), 0.0))
    schedule = Schedule(duration, 0, warmup)
    recs: list[Rec] = []
    run = THREADS[kind]
    args = (target, params) if kind == "grpc" else (target, model, params)
    pool = [
        threading.Thread(target=run, args=(*args, schedule, recs, first + i * step, step * threads))
        for i in range(threads)
    ]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return recs


def level(
    pool, processes: int, kind: str, target: str, model: str, c: int, params, args, label=None
) -> dict:
    """C closed loops of `kind` (THREADS) spread over `processes` client processes, for
    args.warmup + args.duration s; `label` names the side in the progress line."""
    parts = min(c, processes)
    per = [c // parts + (i < c % parts) for i in range(parts)]
    start = now() + START_DELAY_S
    futures = [
        pool.submit(
            _client_part,
            kind,
            target,
            model,
            params,
            n,
            i,
            parts,
            start,
            args.duration,
            args.warmup,
        )
        for i, n in enumerate(per)
    ]
    recs = [r for f in futures for r in f.result()]
    window = (start + args.warmup, start + args.warmup + args.duration)
    stats = summarize(recs, window)
    finished = [r for r in recs if r.measured and r.error is None and r.final]
    inside = [r for r in finished if window[0] <= r.end <= window[1]]
    stats["tok_s_finished"] = round(sum(len(r.final["tokens"]) for r in inside) / args.duration, 2)
    # Every request that ended in the window, warm-up ones too: in steady state this is the
    # unbiased rate (the above drops the first request latency's worth of the window).
    ended = [r for r in recs if r.error is None and r.final and window[0] <= r.end <= window[1]]
    stats["tok_s_ended"] = round(sum(len(r.final["tokens"]) for r in ended) / args.duration, 2)
    stats["requests_ended"] = len(ended)
    stats["errors"] = sum(1 for r in recs if r.error)
    if failed := [r for r in recs if r.error]:
        stats["error_sample"] = f"{failed[0].error}: {failed[0].detail or ''}".strip(": ")
    print(
        f"  C={c} {label or kind}: {stats['tok_s_finished']} tok/s "
        f"({stats['tok_s_ended']} counting warm-up requests), "
        f"TTFT p50 {stats['ttft_ms_p50']} ms, {stats['errors']} failed",
        file=sys.stderr,
    )
    return stats


def http_vs_grpc(address: str, http_url: str, model: str, levels: list[int], params, args):
    """Per level and round: gRPC and HTTP (swapped each round); the ratio is the median over
    rounds of HTTP tok/s / gRPC tok/s."""
    out: dict = {
        "levels": {},
        "client_processes": args.client_processes,
        "tok_s": "completion tokens of requests finished in the window / window",
    }
    with ProcessPoolExecutor(args.client_processes, mp_context=get_context("spawn")) as pool:
        for f in [pool.submit(_ready) for _ in range(args.client_processes)]:
            f.result()
        for c in levels:
            rounds = []
            for r in range(args.http_rounds):
                order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
                runs = {}
                for kind in order:
                    target = address if kind == "grpc" else http_url
                    runs[kind] = level(
                        pool, args.client_processes, kind, target, model, c, params, args
                    )
                runs["http_over_grpc_tok_s"] = _ratio(
                    runs["http"]["tok_s_finished"], runs["grpc"]["tok_s_finished"]
                )
                runs["http_over_grpc_ttft_p50"] = _ratio(
                    runs["http"]["ttft_ms_p50"], runs["grpc"]["ttft_ms_p50"]
                )
                rounds.append(runs)
            out["levels"][str(c)] = {
                "rounds": rounds,
                "http_over_grpc_tok_s": _median([r["http_over_grpc_tok_s"] for r in rounds]),
                "http_over_grpc_ttft_p50": _median([r["http_over_grpc_ttft_p50"] for r in rounds]),
            }
    return out


def http_url_of(log: list[str]) -> str:
    for line in reversed(log):
        if m := re.search(r"HTTP API on (http://\S+/v1)", line):
            return m.group(1)
    raise RuntimeError("the coordinator did not report an HTTP API")


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _median(values):
    values = [v for v in values if v is not None]
    return round(float(np.median(values)), 3) if values else None


def plot_http(result: dict, path) -> None:
    """tok/s and TTFT p50 per level, gRPC vs HTTP (each round a point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["http_vs_grpc"]["levels"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, style in (("grpc", "o-"), ("http", "s--")):
        for key, ax in (("tok_s_finished", a), ("ttft_ms_p50", b)):
            cs, ys = [], []
            for c, data in levels.items():
                for run in data["rounds"]:
                    cs.append(int(c))
                    ys.append(np.nan if run[kind][key] is None else run[kind][key])
            ax.plot(cs, ys, style, label=kind, alpha=0.8)
    for ax, label in ((a, "aggregate output tok/s"), (b, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"HTTP (openai package) vs gRPC: {result['model']}, {result['device']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
