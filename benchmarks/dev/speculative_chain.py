"""What each kind of decode forward costs in speculative mode (issue 35): the engine's own
forwards, timed as the engine prices them (step_cost.py), split by how they were launched.

Greedy requests on counting prompts, one at a time, with a fixed draft break-even (so the
decisions do not depend on timing), in three settings run interleaved --repeats times: AR,
speculative with mask drafts reading each forward back before the next, and the same with
the engine's speculative_ahead (the next verifying forward built on the device,
speculative_ahead.py). Each forward's wall time is the time since the previous read-back
(launched ahead of it) or since its own launch (launched after it), split into
  chained   built on the device before the read-back (speculative_ahead)
  ahead     AR's look-ahead (one row, or a mask probe riding it)
  serial    launched after the read-back
and by width: `one` (one row per sequence) or `wide` (drafts or mask slots). Medians in
ms, and each setting's decode tok/s (medians over rounds, and against AR's of the same
round). Prints one JSON object and writes speculative_chain.json to --out.

  python benchmarks/dev/speculative_chain.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks.dev.bench_io import finish, run_info
from benchmarks.dev.speculative import COUNTING, WEDLM_MODEL
from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine

# name: (mode, the engine's speculative_ahead)
SETTINGS = {
    "ar": ("ar", False),
    "read_back": ("speculative", False),
    "chained": ("speculative", True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=WEDLM_MODEL)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--break-even", type=float, default=1.5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative_chain"))
    args = ap.parse_args()
    local = open_local_engine(args.model, num_rows=8)
    engine = local.engine
    prompts = [local.tokenizer.encode(t) for t in COUNTING[: args.prompts]]
    engine.step_cost.seed({b: args.break_even for b in (1, 2, 4, 8)})
    engine.step_cost.online = False
    timed: list[tuple[str, float]] = []
    time_forward = engine._time_forward

    def timing(flight) -> None:  # the engine's own clock, read before it moves on
        done, last = time.perf_counter(), engine._last_done
        how = "chained" if flight.unresolved else "ahead" if flight.started < last else "serial"
        wide = "wide" if any(p.width > p.keep for p in flight.plans) else "one"
        timed.append((f"{how}/{wide}", done - max(flight.started, last)))
        time_forward(flight)

    engine._time_forward = timing

    def run(name: str) -> float:
        mode, chained = SETTINGS[name]
        engine.speculative_ahead = chained
        params = GenerationParams(mode=mode, draft="mask" if mode != "ar" else "auto",
                                  window=8, threshold=1.5, max_tokens=args.max_tokens)  # fmt: skip
        tokens, decode = 0, 0.0
        for prompt in prompts:
            seq = engine.submit(prompt, params)
            for _ in engine.stream([seq]):
                pass
            tokens, decode = tokens + len(seq.output) - 1, decode + seq.decode_s
        return tokens / decode

    for name in SETTINGS:  # every shape compiled before anything is timed
        run(name)
    forwards: dict[str, dict[str, list[float]]] = {name: {} for name in SETTINGS}
    speed: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name in SETTINGS:
            timed.clear()
            speed[name].append(run(name))
            for kind, seconds in timed:
                forwards[name].setdefault(kind, []).append(seconds * 1e3)
    result = run_info(model=str(args.model), break_even=args.break_even,
                      max_tokens=args.max_tokens, prompts=len(prompts))  # fmt: skip
    for name in SETTINGS:
        result[name] = {
            "decode_tok_s": round(statistics.median(speed[name]), 1),
            "vs_ar": round(
                statistics.median(s / a for s, a in zip(speed[name], speed["ar"], strict=True)), 3
            ),
            "forwards": {
                k: {
                    "count": len(v),
                    "median_ms": round(statistics.median(v), 2),
                    "p90_ms": round(float(np.percentile(v, 90)), 2),
                    "max_ms": round(max(v), 2),
                }
                for k, v in sorted(forwards[name].items())
            },
        }
    finish(result, args.out, "speculative_chain")


if __name__ == "__main__":
    main()
