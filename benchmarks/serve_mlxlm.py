"""Closed-loop measurement shared by benchmarks/serve.py, and its mlx-lm side: the same loop
on mlx-lm's BatchGenerator, in process, greedy AR, the same prompts, max_tokens and stop
ids, with C sequences kept in the batch (when one finishes the next is inserted). Run as a
module it prints one JSON object (per level); serve.py runs it in a subprocess.

  python -m benchmarks.serve_mlxlm --model PATH --concurrency 1 2 4 --max-tokens 24
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
now = time.perf_counter
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
    return float(np.percentile(values, q)) if values else None


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


# ---- mlx-lm BatchGenerator -----------------------------------------------------------------
class Arrivals:
    """When a closed loop's next requests come: at once, or each after a random delay of
    up to `delay_s` (a client's round trip: arrivals then scatter as they do over a
    network). `due()` says how many are due now."""

    def __init__(self, delay_s: float = 0.0, seed: int = 0) -> None:
        self.delay_s = delay_s
        self._rng = np.random.default_rng(seed)
        self._times: list[float] = []

    def later(self) -> None:
        self._times.append(now() + self._rng.uniform(0.0, self.delay_s))

    def due(self) -> int:
        t = now()
        ready = [x for x in self._times if x <= t]
        self._times = [x for x in self._times if x > t]
        return len(ready)

    @property
    def pending(self) -> bool:
        return bool(self._times)

    def wait(self) -> None:
        """Sleep until the next one is due (nothing else to do)."""
        if self._times:
            time.sleep(max(min(self._times) - now(), 0.0))


def level(model, prompts: list[list[int]], stops: list[int], c: int, args) -> dict:
    """One concurrency level; a token's time is when BatchGenerator hands it back.
    `args.arrival_delay_ms` (optional): each next request comes up to that much later."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=args.max_tokens, stop_tokens=[[t] for t in stops],
                         completion_batch_size=c, prefill_batch_size=c)  # fmt: skip
    schedule = Schedule(args.duration, args.requests, args.warmup)
    arrivals = Arrivals(getattr(args, "arrival_delay_ms", 0.0) / 1e3)
    recs: list[Rec] = []
    live: dict[int, Rec] = {}
    order = itertools.count()

    def insert() -> None:
        if (rec := schedule.next()) is not None:
            live[gen.insert([prompts[next(order) % len(prompts)]])[0]] = rec

    for _ in range(c):
        insert()
    while live or arrivals.pending:
        for _ in range(arrivals.due()):
            insert()
        if not live:
            arrivals.wait()
            continue
        responses = gen.next_generated()
        t = now()
        for r in responses:
            rec = live[r.uid]
            rec.events.append((t, 1))  # a stop token counts, as in the engine's output
            if r.finish_reason is not None:
                rec.end = t
                rec.final = {"tokens_per_forward": 1.0, "forwards": len(rec.events)}
                recs.append(live.pop(r.uid))
                arrivals.later()
    gen.close()
    stats = summarize(recs, schedule.window)
    print(f"  mlx-lm C={c}: {stats['tok_s']} tok/s, TTFT p50 {stats['ttft_ms_p50']} ms",
          file=sys.stderr)  # fmt: skip
    return stats


def sweep_in_subprocess(model: Path, args) -> dict:
    """Its own process, so its weights and KV are gone before the cluster starts."""
    cmd = [sys.executable, "-m", "benchmarks.serve_mlxlm", "--model", str(model),
           "--max-tokens", str(args.max_tokens), "--duration", str(args.duration),
           "--requests", str(args.requests), "--warmup", str(args.warmup),
           "--concurrency", *map(str, args.concurrency)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    sys.stderr.write(out.stderr[-4000:])
    if out.returncode != 0:
        raise RuntimeError(f"the mlx-lm sweep failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import mlx.core as mx

    from benchmarks.engine import mlx_lm_model
    from common.model_parts import load_model_parts
    from common.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=2.0)
    args = ap.parse_args()
    if args.requests:
        args.duration = 0.0
    parts = load_model_parts(args.model)  # the engine's dtype rules (fp32 on a CPU)
    model = mlx_lm_model(parts)  # mlx-lm's model around the very same weights
    mx.eval(model.parameters())
    tok = Tokenizer(args.model)
    stops = sorted(set(parts.config.eos_token_ids) | set(tok.stop_ids))
    prompts = [tok.encode(p) for p in PROMPTS]  # what the coordinator makes of the text
    print(json.dumps({str(c): level(model, prompts, stops, c, args) for c in args.concurrency}))


if __name__ == "__main__":
    main()
