"""One level of a closed loop: C clients spread over several processes (so that the load
generator's own Python, e.g. the `openai` package parsing every chunk, is not what is
measured), all starting at the same moment."""

from __future__ import annotations

from wedlm_client.bench.clients import client_part, ready
from wedlm_client.bench.records import Rec, pct, summarize
from wedlm_client.bench.records import now as clock

# every client process starts its schedule at the same moment: long enough for the pool to
# hand each its part (one process starts at once)
START_DELAY_S = 2.0


def client_pool(processes: int):
    """A pool of spawned client processes, each with its imports done."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    pool = ProcessPoolExecutor(processes, mp_context=get_context("spawn"))
    for f in [pool.submit(ready) for _ in range(processes)]:
        f.result()
    return pool


def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def level(pool, processes: int, kind: str, target: str, model: str | None, c: int, params,
          duration: float, warmup: float, requests: int = 0) -> dict:  # fmt: skip
    """C closed loops of `kind` (clients.THREADS) for warmup + duration s, or until
    `requests` measured requests were sent (duration 0). tok/s: the completion tokens of
    every request that ended inside the measured window (those sent during the warm-up
    too) / its length (None when none did); with `requests`, of every request / first
    submit to last end. With a duration, requests still running records.grace_s after the
    window are cut: counted as unfinished, with their time so far."""
    parts = min(c, processes)
    threads = _split(c, parts)
    quotas = _split(requests, parts) if requests else [0] * parts
    start = clock() + (START_DELAY_S if parts > 1 else 0.0)
    futures = [
        pool.submit(client_part, kind, target, model, params, n, i, parts, start,
                    0.0 if requests else duration, warmup, quotas[i])
        for i, n in enumerate(threads)
    ]
    recs = [r for f in futures for r in f.result()]
    window = None if requests else (start + warmup, start + warmup + duration)
    stats = summarize(recs, window)
    if window is None:
        ended = [r for r in recs if r.error is None and r.final]
        span = stats["wall_s"] or 0.0
    else:
        ended = [r for r in recs if r.error is None and r.final and window[0] <= r.end <= window[1]]
        span = duration
    tokens = sum(len(r.final["tokens"]) for r in ended)
    stats["tok_s_events"] = stats.pop("tok_s")  # token events inside the window / window
    # none ended: nothing was measured (0 would read as a measured standstill)
    stats["tok_s"] = round(tokens / span, 2) if span and ended else None
    stats["requests_ended"] = len(ended)
    stats["sent"] = len(recs)
    stats["failed"] = sum(1 for r in recs if r.error)
    stats.update(unfinished(recs))
    stats["ok"] = stats["sent"] - stats["failed"] - stats["unfinished"]
    if failed := [r for r in recs if r.error]:
        stats["error_sample"] = f"{failed[0].error}: {failed[0].detail or ''}".strip(": ")
    return stats


def unfinished(recs: list[Rec]) -> dict:
    """The requests cut at the deadline: how many, how long they had run (p50, max), the
    tokens they had streamed, and how many had none yet."""
    cut = [r for r in recs if r.unfinished]
    if not cut:
        return {"unfinished": 0}
    ran = [r.end - r.submit for r in cut]
    return {
        "unfinished": len(cut),
        "unfinished_s_p50": round(pct(ran, 50) or 0.0, 1),
        "unfinished_s_max": round(max(ran), 1),
        "unfinished_tokens": sum(n for r in cut for _, n in r.events),
        "unfinished_no_token": sum(1 for r in cut if not r.events),
    }
