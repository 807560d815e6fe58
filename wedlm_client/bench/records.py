"""What a closed loop records per request, which requests it sends, and the percentiles of
what it recorded. Pure Python (no numpy), so the client install can run it."""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
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
    """One request: submit time, (time, tokens) per token event, the final record or error.
    `unfinished`: still running when the run's deadline came (`end` is then that moment:
    its time so far), so it was cancelled and is neither done nor failed."""

    submit: float
    measured: bool = True
    events: list[tuple[float, int]] = field(default_factory=list)
    end: float = 0.0
    final: dict | None = None
    error: str | None = None
    detail: str | None = None  # the error's message
    unfinished: bool = False
    # how to abort it from another thread (not pickled: it stays in the client process)
    cancel: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "cancel": None}


def grace_s(duration: float) -> float:
    """How long requests still running at the end of a measured window may take to end
    before they are cut: a quarter of the window, at most 10 s (so that a slow server
    cannot stretch a 30 s run to minutes)."""
    return min(0.25 * duration, 10.0)


class Schedule:
    """Which requests a closed loop sends and measures. Requests sent during the warm-up
    are not measured; with a duration, requests are sent until warm-up + duration (and
    those still running at `deadline`, grace_s later, are cut), else `requests` measured
    requests are sent in all."""

    def __init__(self, duration: float, requests: int, warmup: float) -> None:
        self.duration, self.requests = duration, requests
        self.warm_end = now() + warmup
        self.stop_at = self.warm_end + duration
        self.deadline = self.stop_at + grace_s(duration) if duration else None
        self._quota = itertools.count()
        self._lock = threading.Lock()
        self._recs: dict[int, Rec] = {}  # the requests in flight, by id()
        self._cut = False

    def next(self) -> Rec | None:
        t = now()
        measured = t >= self.warm_end
        if self.duration and t >= self.stop_at:
            return None
        with self._lock:
            if self._cut:
                return None
            if not self.duration and measured and next(self._quota) >= self.requests:
                return None
            rec = Rec(t, measured)
            self._recs[id(rec)] = rec
        return rec

    def close(self, rec: Rec, recs: list[Rec]) -> bool:
        """A request ended: it joins `recs`, unless it was cut meanwhile (False: its loop
        stops; cut() already returned its record)."""
        with self._lock:
            if self._recs.pop(id(rec), None) is None:
                return False
            recs.append(rec)
            return True

    def cut(self) -> list[Rec]:
        """Stop the schedule and cancel every request still running: copies of them, as
        they stood now, marked unfinished (their threads may still unwind)."""
        t = now()
        with self._lock:
            self._cut = True
            running, self._recs = list(self._recs.values()), {}
        out = []
        for rec in running:
            snap = copy.copy(rec)
            snap.events, snap.end, snap.unfinished = list(rec.events), t, True
            snap.final, snap.error, snap.detail, snap.cancel = None, None, None, None
            out.append(snap)
            if rec.cancel is not None:
                with contextlib.suppress(Exception):  # a failed abort changes nothing measured
                    rec.cancel()
        return out

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
    state); None: tokens of the measured requests / (first submit → last end). TPOT and
    ITL are of the requests that ended; TTFT also of the unfinished ones that had their
    first token."""
    done = [r for r in recs if r.measured and r.error is None and r.events and not r.unfinished]
    if window is not None:
        t0, t1 = window
        tokens = sum(n for r in recs for t, n in r.events if t0 <= t <= t1)
    else:
        mine = [r for r in recs if r.measured] or [Rec(0.0)]
        t0, t1 = min(r.submit for r in mine), max(r.end for r in mine)
        tokens = sum(n for r in done for _, n in r.events)
    # a request cut at the deadline had its first token, if it had one, like any other
    started = done + [r for r in recs if r.unfinished and r.measured and r.events]
    ttft = [r.events[0][0] - r.submit for r in started]
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
