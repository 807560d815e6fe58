"""Arrivals in one process: the engine against mlx-lm's BatchGenerator in the same closed
loop (C sequences decoding; when one finishes the next is submitted at once, AR, greedy,
--max-tokens each), on the same weights. Unlike benchmarks/dev/batch_decode.py (no arrivals)
this includes what arrivals cost: prefill forwards and the decode batch changing
membership; unlike benchmarks/dev/stages.py's `alone` phase it leaves out the serving path
(gRPC, jobs, detokenization), so the two together say where a serving gap comes from.

Engine variants (--variants) differ in the prefill hold (coordinator/engine/scheduler.py) and
the prefix cache: `hold0` prefills new prompts at once, `hold4` lets them wait up to 4 decode
steps to share a prefill forward, a `-cache` suffix adds the prefix cache (as a server runs).
Variants rotate round by round (round 0 warms up); medians over the rounds. Prints one JSON
object and writes arrivals.json to --out.

  python benchmarks/dev/arrivals.py --model random-qwen3-8b --concurrency 16 32 \\
      --variants hold0 hold4
  python benchmarks/dev/arrivals.py --model random-qwen3-8b --layers 2 --hidden 256 --duration 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_io import add_loop_flags, add_random_shape_flags, finish, run_info
from benchmarks.dev.engine import mlx_lm_model, random_qwen3
from benchmarks.dev.serve_mlxlm import Arrivals, Rec, Schedule, now, summarize
from benchmarks.dev.serve_mlxlm import level as mlxlm_level
from common.generation_params import GenerationParams
from common.model_parts import ModelParts, load_model_parts
from coordinator.engine.engine import Engine, Limits
from coordinator.engine.local_engine import resolve_model
from coordinator.engine.pipeline import LocalPipeline
from coordinator.engine.prefix_cache import PrefixCache

KEYS = ("tok_s", "ttft_ms_p50", "tpot_ms_p50", "forwards_per_step", "prefill_forwards_per_step")


def engine_level(parts: ModelParts, prompts, stops, c: int, variant: str, args) -> dict:
    """One concurrency level through a fresh engine (the same loop as mlx-lm's level)."""
    hold, _, extra = variant.removeprefix("hold").partition("-")
    limits = Limits(prefill_hold=int(hold))
    cache = PrefixCache() if extra == "cache" else None
    engine = Engine(
        parts, LocalPipeline(parts), c, stop_ids=tuple(stops), limits=limits, prefix_cache=cache
    )
    params = GenerationParams(mode="ar", max_tokens=args.max_tokens)
    schedule = Schedule(args.duration, args.requests, args.warmup)
    arrivals = Arrivals(args.arrival_delay_ms / 1e3)
    live: dict[int, Rec] = {}
    recs: list[Rec] = []
    order = itertools.count()

    def insert() -> None:
        if (rec := schedule.next()) is not None:
            live[engine.submit(prompts[next(order) % len(prompts)], params).seq_id] = rec

    for _ in range(c):
        insert()
    counted = None  # (forwards, decode forwards, wall) when the measured window opens
    while live or engine.has_work or arrivals.pending:
        for _ in range(arrivals.due()):
            insert()
        if not engine.has_work:
            arrivals.wait()
            continue
        commits = engine.step()
        t = now()
        if counted is None and t >= schedule.warm_end:
            counted = (engine.forwards, engine.scheduler.decode_forwards, t)
        for commit in commits:
            rec = live.get(commit.seq.seq_id)
            if rec is None:
                continue
            if commit.tokens:
                rec.events.append((t, len(commit.tokens)))  # a stop token counts, as in mlx-lm
            if commit.seq.finished:
                rec.end = t
                rec.final = {"tokens_per_forward": 1.0, "forwards": commit.seq.forwards}
                recs.append(live.pop(commit.seq.seq_id))
                arrivals.later()
    stats = summarize(recs, schedule.window)
    if counted is not None:
        forwards = engine.forwards - counted[0]
        decode = engine.scheduler.decode_forwards - counted[1]
        stats["forwards_per_step"] = round(forwards / max(decode, 1), 3)
        stats["prefill_forwards_per_step"] = round((forwards - decode) / max(decode, 1), 3)
    print(f"  engine {variant} C={c}: {stats['tok_s']} tok/s, TTFT p50 {stats['ttft_ms_p50']}"
          f" ms, prefill forwards/step {stats.get('prefill_forwards_per_step')}",
          file=sys.stderr, flush=True)  # fmt: skip
    return stats


def med(rounds: list[dict], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def bench(parts: ModelParts, mlm, prompts, stops, args) -> dict:
    names = ["mlxlm", *args.variants]
    out = {}
    for c in args.concurrency:
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds + 1):  # round 0 warms every variant's shapes up
            for name in names:
                if name == "mlxlm":
                    stats = mlxlm_level(mlm, prompts, stops, c, args)
                else:
                    stats = engine_level(parts, prompts, stops, c, name, args)
                mx.clear_cache()
                if r:
                    runs[name].append(stats)
        medians = {n: {k: med(v, k) for k in KEYS} for n, v in runs.items()}
        base = medians["mlxlm"]["tok_s"]
        out[str(c)] = {
            "medians": medians,
            "over_mlxlm": {
                n: round(m["tok_s"] / base, 3) if base and m["tok_s"] else None
                for n, m in medians.items() if n != "mlxlm"
            },
            "rounds": runs,
        }  # fmt: skip
        print(f"C={c}: {json.dumps(out[str(c)]['over_mlxlm'])}", file=sys.stderr, flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    """Per concurrency level: tok/s of mlx-lm and each engine variant (medians), and the
    prefill forwards each decode step paid."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot", file=sys.stderr)
        return
    levels = result["levels"]
    names = list(next(iter(levels.values()))["medians"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(levels))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        tok = [levels[c]["medians"][name]["tok_s"] or 0 for c in levels]
        axes[0].bar(x + i * width, tok, width, label=name)
        if name != "mlxlm":
            pre = [levels[c]["medians"][name]["prefill_forwards_per_step"] or 0 for c in levels]
            axes[1].bar(x + i * width, pre, width, label=name, color=f"C{i}")
    labels = ("tok/s (median)", "prefill forwards per decode step")
    for ax, label in zip(axes, labels, strict=True):
        ax.set_xticks(x + width * (len(names) - 1) / 2, [f"C={c}" for c in levels])
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    delay = result.get("arrival_delay_ms", 0)
    fig.suptitle(f"{result['model']}: arrivals in one process (delay up to {delay} ms), "
                 f"{result['date']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_shape_flags(ap, "random-qwen3-8b")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["hold0", "hold4"],
        help="engine variants: holdN (prefill hold N steps), optionally with -cache",
    )
    add_loop_flags(ap, max_tokens=64, duration=8.0, warmup=3.0, rounds=2)
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument(
        "--arrival-delay-ms",
        type=float,
        default=0.0,
        help="each next request comes a random 0..this later (as clients over a network), "
        "for both sides; 0: at once (arrivals then stay in step with each other)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--plot-only", type=Path, help="redraw the plot of this arrivals.json")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return
    if args.model == "random-qwen3-8b":
        parts, mlm = random_qwen3(args.layers, args.hidden)
        name = f"random-qwen3-8b(layers={args.layers},hidden={args.hidden})"
        # prompts of 8-12 tokens, as the serving benchmarks' PROMPTS encode to
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(1000, 20000, 8 + i % 5)] for i in range(8)]
        stops = list(parts.config.eos_token_ids)
    else:
        from benchmarks.dev.serve_mlxlm import PROMPTS
        from common.tokenizer import Tokenizer

        path = resolve_model(args.model)
        parts = load_model_parts(path)
        mlm, name = mlx_lm_model(parts), args.model
        tok = Tokenizer(path)
        prompts = [tok.encode(p) for p in PROMPTS]
        stops = sorted(set(parts.config.eos_token_ids) | set(tok.stop_ids))
    result = run_info(model=name, max_tokens=args.max_tokens, duration_s=args.duration,
                      rounds=args.rounds, arrival_delay_ms=args.arrival_delay_ms)  # fmt: skip
    result["levels"] = bench(parts, mlm, prompts, stops, args)
    finish(result, args.out, "arrivals", {"arrivals.png": plot})


if __name__ == "__main__":
    main()
