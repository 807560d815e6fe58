"""What a closed loop records per request, which requests it sends, and the percentiles of
what it recorded. Pure Python (no numpy), so the client install can run it."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

now = time.perf_counter  # CLOCK_MONOTONIC: comparable across the client processes
PROMPTS = (
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who",
    "Explain how a refrigerator works:",
    "The three most important ideas in economics are",
    "Once upon a time, in a small village by the sea,",
    "A recipe for bread: first,",
    "The main differences between cats and dogs are",
    "In the year 2100, cities will",
)


@dataclass
class Rec:
    """One request: submit time, (time, tokens) per token event, the final record or error."""

    submit: float
    measured: bool = True
    events: list[tuple[float, int]] = field(default_factory=list)
    end: float = 0.0
    final: dict | None = None
    error: str | None = None
    detail: str | None = None  # the error's message


class Schedule:
    """Which requests a closed loop sends and measures. Requests sent during the warm-up
    are not measured; with a duration, requests are sent until warm-up + duration, else
    `requests` measured requests are sent in all."""

    def __init__(self, duration: float, requests: int, warmup: float) -> None:
        self.duration, self.requests = duration, requests
        self.warm_end = now() + warmup
        self.stop_at = self.warm_end + duration
        self._quota = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> Rec | None:
        t = now()
        measured = t >= self.warm_end
        if self.duration and t >= self.stop_at:
            return None
        with self._lock:
            if not self.duration and measured and next(self._quota) >= self.requests:
                return None
        return Rec(t, measured)

    @property
    def window(self) -> tuple[float, float] | None:
        return (self.warm_end, self.stop_at) if self.duration else None


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def median(values: list) -> float | None:
    v = pct([x for x in values if x is not None], 50)
    return None if v is None else round(v, 3)


def summarize(recs: list[Rec], window: tuple[float, float] | None) -> dict:
    """window (start, end): tok/s = tokens of every event inside it / its length (steady
    state); None: tokens of the measured requests / (first submit → last end)."""
    done = [r for r in recs if r.measured and r.error is None and r.events]
    if window is not None:
        t0, t1 = window
        tokens = sum(n for r in recs for t, n in r.events if t0 <= t <= t1)
    else:
        mine = [r for r in recs if r.measured] or [Rec(0.0)]
        t0, t1 = min(r.submit for r in mine), max(r.end for r in mine)
        tokens = sum(n for r in done for _, n in r.events)
    ttft = [r.events[0][0] - r.submit for r in done]
    tpot, itl = [], []
    for r in done:
        n = sum(k for _, k in r.events)
        if n > 1:
            tpot.append((r.events[-1][0] - r.events[0][0]) / (n - 1))
        itl += [(b[0] - a[0]) / b[1] for a, b in itertools.pairwise(r.events)]
    tpf = [r.final["tokens_per_forward"] for r in done if r.final and r.final.get("forwards")]
    stats = {"requests": len(done), "tokens": tokens, "wall_s": round(t1 - t0, 3),
             "tok_s": round(tokens / (t1 - t0), 2) if t1 > t0 else None}  # fmt: skip
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            v = pct(values, q)
            stats[f"{name}_ms_p{q}"] = None if v is None else round(1000 * v, 2)
    stats["tokens_per_forward_p50"] = pct(tpf, 50)
    stats["failures"] = dict(Counter(r.error for r in recs if r.measured and r.error))
    return stats
