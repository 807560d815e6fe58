"""Pipeline-stage benchmarks: the coordinator as a pipeline stage, stages relaying to each other,
and a warm start. Prints one JSON object and writes stages.json + stages.png to --out
(stages.partial.json after every phase; a phase that fails is recorded with its error and
the next one runs).

Phases (--phases; they run in this order):
  alone   The coordinator alone (every layer in-process) vs mlx-lm's BatchGenerator
          (benchmarks/dev/serve_mlxlm.py, a subprocess, after ours), AR, closed loop at each
          --concurrency, --rounds alternated: medians of tok/s, TTFT, TPOT; ours / mlx-lm
          per C (target >= 1.0 at every C).
  hops    Per relay hop, worker to worker, beyond grpcio's floor (benchmarks/dev/relay_hops.py
          says how): 16 KiB, 256 KiB and 4 MiB (targets 0.3 ms and 1 ms).
  gpus2   At --gpus2-concurrency, WeDLM and AR: the coordinator (first half of the layers,
          GPU 0) + 1 worker (second half, GPU 1 with --gpus 2) vs the coordinator alone on
          GPU 0, alternated over --rounds: aggregate tok/s ratio (target WeDLM >= 1.6).

  python benchmarks/dev/stages.py --model random-qwen3-8b --phases alone --out OUT
  python benchmarks/dev/stages.py --model random-qwen3-8b --gpus 2 --phases hops gpus2 --out OUT
  python benchmarks/dev/stages.py --replot OUT/stages.json     # only redraw the plot

The phases fresh (a fresh machine's bursts, ST3) and single (3 stages against 1, single
stream), history only, left with issue 55: `git log -S phase_single` finds them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev import bench_io, relay_hops
from benchmarks.dev.bench_cluster import Cluster
from benchmarks.dev.bench_io import add_random_model_flags, device_name, prepare_model, ratio
from benchmarks.dev.serve import grpc_level, sweep
from benchmarks.dev.serve_mlxlm import sweep_in_subprocess
from benchmarks.dev.stages_report import plot, summary
from common.generation_params import GenerationParams
from wedlm_client.bench.records import PROMPTS, now

PHASES = ("alone", "hops", "gpus2")
STARTUP_S = 90  # what a phase's processes take to start, for the time budget (a guess)


def log(text: str) -> None:
    bench_io.log(text, "stages")


def med(values) -> float | None:
    return bench_io.med(values, 3)


class Run:
    """The model, the flags, and the coordinator alone (shared by the phases)."""

    def __init__(self, args, model: Path) -> None:
        self.args, self.model = args, model
        self.alone: Cluster | None = None
        self.alone_address = ""
        self.clusters: list[Cluster] = []
        self.max_running = max([*args.concurrency, args.gpus2_concurrency])

    def cluster(self, workers: int, max_running: int, gpus: int) -> Cluster:
        log(f"starting {workers} worker(s)")
        c = Cluster(self.model, workers, max_running, gpus=gpus, local=True)
        if self.args.warm_up:
            c.flags = ("--warm-up", self.args.warm_up)
        c.flags = (*c.flags, *shlex.split(self.args.coordinator_flags))
        self.clusters.append(c)
        return c

    def start_alone(self) -> str:
        if self.alone is None:
            self.alone = self.cluster(0, self.max_running, self.args.gpus)
        log("starting the coordinator alone")
        self.alone_address = self.alone.start_coordinator()
        log(f"coordinator alone serving at {self.alone_address}: {self.alone.startup}")
        return self.alone_address

    def alone_serving(self) -> str:
        return self.alone_address or self.start_alone()

    def stop(self) -> None:
        for c in self.clusters:
            c.stop()


# ---- the coordinator alone vs mlx-lm ---------------------------------------------------------
def level_medians(rounds: list[dict]) -> dict:
    keys = ("tok_s", "ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50")
    return {c: {k: med(r[c][k] for r in rounds) for k in keys} for c in rounds[0]}


def phase_alone(run: Run) -> dict:
    args = run.args
    address = run.alone_serving()
    levels = sorted(args.concurrency)
    params = GenerationParams(mode="ar", max_tokens=args.max_tokens)
    ours, theirs = [], []
    for r in range(args.rounds):
        log(f"alone: round {r + 1}/{args.rounds}, ours")
        ours.append(sweep(address, levels, PROMPTS, params, args))
        # One process on the GPU at a time: ours holds its weights and MLX's buffer cache.
        run.alone.stop_coordinator()
        run.alone_address = ""
        log(f"alone: round {r + 1}/{args.rounds}, mlx-lm BatchGenerator")
        theirs.append(sweep_in_subprocess(run.model, args))
        address = run.start_alone()
    o, m = level_medians(ours), level_medians(theirs)
    per_c = {
        c: {
            "tok_s": ratio(o[c]["tok_s"], m[c]["tok_s"]),
            "tpot": ratio(m[c]["tpot_ms_p50"], o[c]["tpot_ms_p50"]),
        }
        for c in o
    }
    tok = [v["tok_s"] for v in per_c.values() if v["tok_s"] is not None]
    return {
        "ours": o,
        "mlxlm": m,
        "ours_over_mlxlm": per_c,
        "ours_over_mlxlm_min": min(tok) if tok else None,
        "rounds": {"ours": ours, "mlxlm": theirs},
        "note": "ratios of the medians over rounds; tpot ratio = mlx-lm TPOT / ours",
    }


# ---- per hop, worker to worker ---------------------------------------------------------------
def phase_hops(run: Run) -> dict:
    args = run.args
    payloads = tuple(int(k * 1024) for k in args.hop_kib)
    return relay_hops.measure(run.model, args.gpus, args.hop_repeats, 20, payloads)


# ---- two GPUs: coordinator + 1 worker vs the coordinator alone ------------------------------
def phase_gpus2(run: Run) -> dict:
    args = run.args
    c = args.gpus2_concurrency
    with ThreadPoolExecutor(1) as pool:  # both start at once (they load and warm up)
        first = pool.submit(run.alone_serving)
        two = run.cluster(1, c, args.gpus)
        log(f"gpus2: 2 stages: {two.layout()}")
        address2 = two.start_coordinator(micro_batches=args.gpus2_micro_batches or None)
        alone = first.result()
    rounds = []
    for r in range(args.rounds):
        entry: dict = {}
        for mode in ("wedlm", "ar"):
            params = GenerationParams(mode=mode, max_tokens=args.max_tokens)
            log(f"gpus2: round {r + 1}/{args.rounds}, {mode}")
            one = grpc_level(alone, c, PROMPTS, params, args)
            both = grpc_level(address2, c, PROMPTS, params, args)
            entry[mode] = {
                "alone": one,
                "two_stages": both,
                "ratio": ratio(both["tok_s"], one["tok_s"]),
            }
        rounds.append(entry)
    counted = rounds[1:] if len(rounds) > 1 else rounds
    out: dict = {
        "concurrency": c,
        "layout_2": two.layout(),
        "startup_2": two.startup,
        "startup_alone": run.alone.startup,
        "micro_batches": args.gpus2_micro_batches or "server default (1 per stage)",
        "rounds": rounds,
        "counted_rounds": len(counted),
    }
    for mode in ("wedlm", "ar"):
        out[mode] = {
            "alone_tok_s": med(x[mode]["alone"]["tok_s"] for x in counted),
            "two_stages_tok_s": med(x[mode]["two_stages"]["tok_s"] for x in counted),
            "ratio": med(x[mode]["ratio"] for x in counted),
            "ratio_all_rounds": [x[mode]["ratio"] for x in rounds],
            "hops_2": rounds[-1][mode]["two_stages"]["hops"],
        }
    two.stop()
    return out


# ---- driver ----------------------------------------------------------------------------------
def estimate_s(phase: str, args) -> float:
    level = args.warmup + (args.duration or 10)
    return (
        STARTUP_S
        + {
            "alone": args.rounds * 2 * len(args.concurrency) * level + 20 * args.rounds,
            "hops": 40,
            "gpus2": args.rounds * 4 * level,
        }[phase]
    )


def save(result: dict, args, name: str) -> None:
    (args.out / name).write_text(json.dumps(result, indent=1))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_model_flags(ap, "random-qwen3-8b")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=["alone"])
    ap.add_argument("--gpus", type=int, default=0, help="GPUs: coordinator on 0, workers on 1..")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32], help="alone")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per closed-loop level")
    ap.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="alone and gpus2: alternated rounds")
    ap.add_argument(
        "--warm-up",
        choices=("auto", "on", "off"),
        help="passed to every coordinator (default: the server's, auto = on GPUs only)",
    )
    ap.add_argument(
        "--coordinator-flags",
        default="",
        help="extra flags for every coordinator started, e.g. '--prefill-hold 0'",
    )
    ap.add_argument("--hop-kib", type=float, nargs="+", default=[16, 256, 4096])
    ap.add_argument("--hop-repeats", type=int, default=150)
    ap.add_argument("--gpus2-concurrency", type=int, default=32)
    ap.add_argument("--gpus2-micro-batches", type=int, default=0, help="0: the server's default")
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; 0 = none")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    ap.add_argument("--replot", type=Path, help="redraw the plot of this stages.json and exit")
    args = ap.parse_args()
    args.requests = 0  # serve.py's closed loop: by duration
    return args


def main() -> None:
    args = parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups on a kill
    t_start = now()
    deadline = t_start + args.time_budget if args.time_budget else float("inf")
    args.out.mkdir(parents=True, exist_ok=True)
    model, name = prepare_model(args)
    import mlx.core as mx

    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        or None
    )
    result: dict = {
        "model": name,
        "device": device_name(),
        "mlx": mx.__version__,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "setup_s": round(now() - t_start, 1),
    }
    log(f"model {name} ready in {result['setup_s']} s")
    run = Run(args, model)
    try:
        for phase in (p for p in PHASES if p in args.phases):
            left = deadline - now()
            if left < estimate_s(phase, args):
                result[phase] = {"skipped": f"time budget: {left:.0f} s left"}
                log(f"{phase}: skipped ({left:.0f} s left)")
                continue
            log(f"phase {phase}")
            t0 = now()
            try:
                result[phase] = globals()[f"phase_{phase}"](run)
            except Exception as e:
                result[phase] = {
                    "error": f"{type(e).__name__}: {e}"[:4000],
                    "traceback": traceback.format_exc()[-3000:],
                    "coordinator_logs": [  # what the serving processes said last
                        "".join(c.coordinator.log[-40:])[-4000:]
                        for c in run.clusters
                        if c.coordinator is not None
                    ],
                }
                log(f"{phase} failed: {type(e).__name__}: {str(e)[:500]}")
            result[phase]["phase_s"] = round(now() - t0, 1)
            save(result, args, "stages.partial.json")
    finally:
        run.stop()
        result["summary"] = summary(result)
        result["total_s"] = round(now() - t_start, 1)
        save(result, args, "stages.json")
    try:
        plot(result, args.out / "stages.png")
    except Exception as e:  # matplotlib missing on the machine: --replot later
        result["plot"] = f"{type(e).__name__}: {e}"
        save(result, args, "stages.json")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
