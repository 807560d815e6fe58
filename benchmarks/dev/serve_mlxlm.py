"""The mlx-lm side of benchmarks/dev/serve.py's closed loop: the same loop on mlx-lm's
BatchGenerator, in process, greedy AR, the same prompts, max_tokens and stop ids,
with C sequences kept in the batch (when one finishes the next is inserted). Run as a
module it prints one JSON object (per level); serve.py runs it in a subprocess.

  python -m benchmarks.dev.serve_mlxlm --model PATH --concurrency 1 2 4 --max-tokens 24
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from wedlm_client.bench.records import PROMPTS, Rec, Schedule, now, summarize

ROOT = Path(__file__).resolve().parents[2]
# the closed loop's records live in the `wedlm bench` tool; re-exported for these scripts
__all__ = ["PROMPTS", "Arrivals", "Rec", "Schedule", "now", "summarize"]


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
    cmd = [sys.executable, "-m", "benchmarks.dev.serve_mlxlm", "--model", str(model),
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

    from benchmarks.dev.engine import mlx_lm_model
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
