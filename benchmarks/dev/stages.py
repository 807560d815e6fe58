"""Pipeline-stage benchmarks: the coordinator as a pipeline stage, stages relaying to each other,
and a warm start. Prints one JSON object and writes stages.json + stages.png to --out
(stages.partial.json after every phase; a phase that fails is recorded with its error and
the next one runs).

Phases (--phases; they run in this order):
  fresh   The coordinator alone (every layer in-process) started with empty kernel caches
          (MLX_PTX_CACHE_DIR and CUDA_CACHE_PATH in a new folder, as on a fresh machine).
          As soon as it says it serves (after its warm-up), --burst requests at once (AR and
          WeDLM alternating, --burst-modes); when all have ended, the identical burst again,
          same process. TTFT p50 first / second (target <= 2). With --compare-no-warm-up,
          the same on a second fresh coordinator started with `--warm-up off`.
  alone   That coordinator (started now if `fresh` did not run) vs mlx-lm's BatchGenerator
          (benchmarks/dev/serve_mlxlm.py, a subprocess, after ours), AR, closed loop at each
          --concurrency, --rounds alternated: medians of tok/s, TTFT, TPOT; ours / mlx-lm
          per C (target >= 1.0 at every C).
  single  Single stream: 3 stages (coordinator + 2 workers) vs 1 (the coordinator alone), AR
          and WeDLM, --single-repeats requests of each, interleaved: client-side time per
          output token (TPOT, medians), against single + 2 x (echo floor + 0.3 ms), with the
          echo floor (benchmarks/dev/grpc_floor.py) measured here at a hop's payload.
  hops    Per relay hop, worker to worker, beyond grpcio's floor (benchmarks/dev/relay_hops.py
          says how): 16 KiB, 256 KiB and 4 MiB (targets 0.3 ms and 1 ms).
  gpus2   At --gpus2-concurrency, WeDLM and AR: the coordinator (first half of the layers,
          GPU 0) + 1 worker (second half, GPU 1 with --gpus 2) vs the coordinator alone on
          GPU 0, alternated over --rounds: aggregate tok/s ratio (target WeDLM >= 1.6).

  python benchmarks/dev/stages.py --model random-qwen3-8b --phases fresh alone single --out OUT
  python benchmarks/dev/stages.py --model random-qwen3-8b --gpus 2 --phases hops gpus2 --out OUT
  python benchmarks/dev/stages.py --replot OUT/stages.json     # only redraw the plot
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev import grpc_floor, relay_hops
from benchmarks.dev.bench_cluster import Cluster
from benchmarks.dev.bench_io import add_random_model_flags
from benchmarks.dev.serve import grpc_level, hop_timings, prepare_model, ratio, sweep
from benchmarks.dev.serve_mlxlm import sweep_in_subprocess
from benchmarks.dev.stages_report import TARGETS, plot, summary
from common.generation_params import GenerationParams
from common.model_config import load_model_config
from wedlm_client.bench.clients import stream_request
from wedlm_client.bench.records import PROMPTS, Rec, now
from wedlm_client.client import WedlmClient

PHASES = ("fresh", "alone", "single", "hops", "gpus2")
STARTUP_S = 90  # what a phase's processes take to start, for the time budget (a guess)


def log(text: str) -> None:
    print(f"[stages {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(float(statistics.median(values)), 3) if values else None


class Run:
    """The model, the flags, and the coordinator alone (shared by the phases)."""

    def __init__(self, args, model: Path) -> None:
        self.args, self.model = args, model
        self.config = load_model_config(model)
        self.alone: Cluster | None = None
        self.alone_address = ""
        self.clusters: list[Cluster] = []
        self.max_running = max([*args.concurrency, args.burst, args.gpus2_concurrency])

    def cluster(self, workers: int, max_running: int, gpus: int) -> Cluster:
        log(f"starting {workers} worker(s)")
        c = Cluster(self.model, workers, max_running, gpus=gpus, local=True)
        if self.args.warm_up:
            c.flags = ("--warm-up", self.args.warm_up)
        c.flags = (*c.flags, *shlex.split(self.args.coordinator_flags))
        self.clusters.append(c)
        return c

    def start_alone(self, env: dict[str, str] | None = None) -> str:
        if self.alone is None:
            self.alone = self.cluster(0, self.max_running, self.args.gpus)
        log("starting the coordinator alone" + (" (fresh kernel caches)" if env else ""))
        self.alone_address = self.alone.start_coordinator(env=env)
        log(f"coordinator alone serving at {self.alone_address}: {self.alone.startup}")
        return self.alone_address

    def alone_serving(self) -> str:
        return self.alone_address or self.start_alone()

    def stop(self) -> None:
        for c in self.clusters:
            c.stop()


# ---- fresh start ---------------------------------------------------------------------------
def burst(address: str, n: int, modes: list[str], max_tokens: int, timeout: float) -> dict:
    """n requests sent at once (a barrier), each read to its end."""
    barrier = threading.Barrier(n)
    recs: list[Rec | None] = [None] * n

    def one(i: int) -> None:
        params = GenerationParams(mode=modes[i % len(modes)], max_tokens=max_tokens)
        with WedlmClient(address, timeout=timeout) as client:
            barrier.wait()
            rec = Rec(now())
            stream_request(client, PROMPTS[i % len(PROMPTS)], params, rec)
            rec.end = now()
            recs[i] = rec

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    done = [r for r in recs if r is not None]
    t0 = min((r.submit for r in done), default=0.0)
    # A request with no token counts as never (inf): a p50 exists only if half had one.
    ttft = [r.events[0][0] - r.submit if r and r.events else float("inf") for r in recs]
    ok = [r for r in done if r.error is None and r.final is not None]
    e2e = [r.end - r.submit for r in ok]
    out = {
        "requests": n,
        "completed": len(ok),
        "modes": [modes[i % len(modes)] for i in range(n)],
        "errors": dict(Counter(r.error for r in done if r.error)),
        "ttft_ms_p50": _ms(statistics.median(ttft)),
        "ttft_ms_p90": _ms(float(np.percentile(ttft, 90))),
        "ttft_ms_max": _ms(max(ttft)),
        "e2e_ms_p50": _ms(statistics.median(e2e)) if e2e else None,
        "completed_within_10s": sum(1 for s in e2e if s <= 10.0),
        "wall_s": round(max((r.end for r in done), default=t0) - t0, 3),
        "ttft_ms": [_ms(v) for v in ttft],
    }
    pairs = list(zip(ttft, out["modes"], strict=True))
    out["ttft_ms_p50_by_mode"] = {
        m: _ms(statistics.median([v for v, k in pairs if k == m]))
        for m in modes
        if any(k == m for _, k in pairs)
    }
    return out


def _ms(seconds: float) -> float | None:
    return None if seconds == float("inf") else round(seconds * 1e3, 2)


def server_has_flag(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "coordinator.service.server_cli", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return flag in out.stdout


def fresh_caches() -> dict[str, str]:
    base = Path(tempfile.mkdtemp(prefix="wedlm-fresh-"))
    return {"MLX_PTX_CACHE_DIR": str(base / "ptx"), "CUDA_CACHE_PATH": str(base / "cuda")}


def two_bursts(address: str, args) -> dict:
    modes = args.burst_modes
    first = burst(address, args.burst, modes, args.max_tokens, args.burst_timeout)
    log(f"  first burst: TTFT p50 {first['ttft_ms_p50']} ms, {first['completed']} completed")
    second = burst(address, args.burst, modes, args.max_tokens, args.burst_timeout)
    log(f"  second burst: TTFT p50 {second['ttft_ms_p50']} ms, {second['completed']} completed")
    by_mode = {
        m: ratio(first["ttft_ms_p50_by_mode"][m], second["ttft_ms_p50_by_mode"][m])
        for m in first["ttft_ms_p50_by_mode"]
    }
    return {
        "first": first,
        "second": second,
        "ttft_ratio": ratio(first["ttft_ms_p50"], second["ttft_ms_p50"]),
        "ttft_ratio_by_mode": by_mode,
    }


def phase_fresh(run: Run) -> dict:
    args = run.args
    env = fresh_caches()
    address = run.start_alone(env=env)
    out = {"caches": env, "startup": run.alone.startup, **two_bursts(address, args)}
    out["meets_target"] = out["ttft_ratio"] is not None and out["ttft_ratio"] <= 2.0
    if not server_has_flag("--warm-up"):
        out["no_warm_up"] = "not compared: `wedlm-coordinator serve` has no --warm-up flag"
    elif args.compare_no_warm_up:
        other = run.cluster(0, run.max_running, args.gpus)
        try:
            log("starting a coordinator alone with --warm-up off (fresh kernel caches)")
            env2 = fresh_caches()
            address2 = other.start_coordinator(env=env2, flags=("--warm-up", "off"))
            out["no_warm_up"] = {
                "caches": env2,
                "startup": other.startup,
                **two_bursts(address2, args),
            }
        finally:
            other.stop()
    return out


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


# ---- single stream: 3 stages vs 1 ------------------------------------------------------------
def stream_once(client: WedlmClient, ids: list[int], params: GenerationParams) -> dict:
    t0, events, final = now(), [], None
    for event in client.generate_stream(ids=ids, params=params):
        if event[0] == "tokens":
            events.append((now(), len(event[1])))
        else:
            final = event[1]
    n = sum(k for _, k in events)
    tpot = (events[-1][0] - events[0][0]) / (n - 1) if n > 1 else None
    return {
        "tpot_ms": tpot * 1e3 if tpot else None,
        "ttft_ms": (events[0][0] - t0) * 1e3 if events else None,
        "step_ms": final["decode_s"] / max(final["forwards"], 1) * 1e3,
        "tokens": final["tokens"],
        "finish_reason": final["finish_reason"],
    }


def phase_single(run: Run) -> dict:
    args = run.args
    if run.alone_address:  # a fresh process: the sweeps' buffer cache is gone
        run.alone.stop_coordinator()
        run.alone_address = ""
    one = run.alone_serving()
    three = run.cluster(2, 4, args.gpus)
    log(f"single: 3 stages: {three.layout()}")
    address3 = three.start_coordinator()
    hidden = run.config.hidden_size
    sizes = {"ar": 2 * hidden, "wedlm": 16 * 2 * hidden, "wedlm_32_rows": 32 * 2 * hidden}
    floor = grpc_floor.measure(sorted(set(sizes.values())), args.floor_repeats)
    vocab = run.config.vocab_size
    ids = np.random.default_rng(1).integers(min(100, vocab // 10), min(vocab, 5000), 32)
    prompt = [int(t) for t in ids]
    modes = {m: GenerationParams(mode=m, max_tokens=args.single_tokens) for m in ("ar", "wedlm")}
    runs = {m: {"1": [], "3": []} for m in modes}
    equal = dict.fromkeys(modes, True)
    with WedlmClient(one) as c1, WedlmClient(address3) as c3:
        for r in range(args.single_repeats + 1):  # round 0 is not counted
            for m, params in modes.items():
                a, b = stream_once(c1, prompt, params), stream_once(c3, prompt, params)
                equal[m] &= a["tokens"] == b["tokens"]
                if r:
                    runs[m]["1"].append(a)
                    runs[m]["3"].append(b)
        out: dict = {
            "layout_3": three.layout(),
            "startup_3": three.startup,
            "prompt_tokens": len(prompt),
            "tokens": args.single_tokens,
            "echo_floor_ms": {k: round(floor[str(v)], 4) for k, v in sizes.items()},
            "hop_bytes": sizes,
        }
    allowance = TARGETS["single_hop_allowance_ms"]
    for m in modes:
        s, t = runs[m]["1"], runs[m]["3"]
        single = med(x["tpot_ms"] for x in s)
        bound = single + 2 * (out["echo_floor_ms"][m] + allowance) if single else None
        three_ms = med(x["tpot_ms"] for x in t)
        out[m] = {
            "tpot_ms_1_stage": single,
            "tpot_ms_3_stages": three_ms,
            "step_ms_1_stage": med(x["step_ms"] for x in s),
            "step_ms_3_stages": med(x["step_ms"] for x in t),
            "bound_ms": round(bound, 3) if bound else None,
            "meets_bound": bool(bound and three_ms and three_ms <= bound),
            "ratio": ratio(three_ms, single),
            "tpot_runs_ms": {
                "1": [round(x["tpot_ms"] or 0, 3) for x in s],
                "3": [round(x["tpot_ms"] or 0, 3) for x in t],
            },
            "finish_reasons": sorted({x["finish_reason"] for x in s + t}),
            "tokens_equal": equal[m],
        }
        if m == "wedlm" and single:
            out[m]["bound_ms_32_rows"] = round(
                single + 2 * (out["echo_floor_ms"]["wedlm_32_rows"] + allowance), 3
            )
        log(
            f"  single {m}: 1 stage {single} ms, 3 stages {three_ms} ms, bound {out[m]['bound_ms']}"
        )
    out["hops_3"] = hop_timings(address3)
    three.stop()
    return out


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
            "fresh": 2 * 20,
            "alone": args.rounds * 2 * len(args.concurrency) * level + 20 * args.rounds,
            "single": 20 + 2 * (args.single_repeats + 1) * 2,
            "hops": 40,
            "gpus2": args.rounds * 4 * level,
        }[phase]
    )


def save(result: dict, args, name: str) -> None:
    (args.out / name).write_text(json.dumps(result, indent=1))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_model_flags(ap, "random-qwen3-8b")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=["fresh", "alone", "single"])
    ap.add_argument("--gpus", type=int, default=0, help="GPUs: coordinator on 0, workers on 1..")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32], help="alone")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per closed-loop level")
    ap.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="alone and gpus2: alternated rounds")
    ap.add_argument("--burst", type=int, default=16, help="fresh: requests per burst")
    ap.add_argument("--burst-modes", nargs="+", choices=("ar", "wedlm"), default=["ar", "wedlm"])
    ap.add_argument("--burst-timeout", type=float, default=180.0)
    ap.add_argument(
        "--compare-no-warm-up",
        action="store_true",
        help="fresh: also two bursts on a fresh coordinator started with --warm-up off",
    )
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
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--single-repeats", type=int, default=5)
    ap.add_argument("--floor-repeats", type=int, default=200)
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

    try:
        device = f"{mx.default_device()} {mx.device_info().get('device_name', '')}".strip()
    except Exception:
        device = str(mx.default_device())
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        or None
    )
    result: dict = {
        "model": name,
        "device": device,
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
