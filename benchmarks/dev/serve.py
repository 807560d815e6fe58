"""Serving benchmark: a closed-loop load generator over the coordinator's gRPC API, on a
cluster it starts.

At each concurrency C, C client threads each send a request, wait for it to finish and send
the next. Per level: aggregate output tok/s, TTFT, time per output token (TPOT), inter-token
latency (ITL), tokens per forward and failures (`grpc_level`, which stages.py shares).
Phases: pipeline, 1 vs P micro-batches in flight (--workers >= 2); http, the `openai`
package against gRPC (serve_http.py). Prints one JSON object and writes serve.json (and
serve-http.png) to --out. The phases sweep, mlxlm and wedlm (runs S1-S6, WV1, history
only) left with issue 55: `git log -S run_wedlm_phase` finds them; `wedlm bench serve`
sweeps a running cluster.

  python benchmarks/dev/serve.py --model random-qwen3-8b --workers 2 --phases pipeline
  python benchmarks/dev/serve.py --model default --workers 0 --phases http --concurrency 1 16 32
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_cluster import GPUS_HELP, Cluster
from benchmarks.dev.bench_io import (
    add_random_model_flags,
    device_name,
    finish,
    prepare_model,
    ratio,
    save_json,
)
from benchmarks.dev.serve_http import http_url_of, http_vs_grpc, plot_http
from common.generation_params import GenerationParams
from wedlm_client.bench.clients import grpc_thread, stream_request
from wedlm_client.bench.records import PROMPTS, Rec, Schedule, now, summarize
from wedlm_client.client import WedlmClient

TARGETS = {"pipeline_p_over_1": 1.3, "http_over_grpc_tok_s": 0.95}
PHASES = ("pipeline", "http")


# ---- the closed loop over gRPC -------------------------------------------------------------
def grpc_level(
    address: str, c: int, prompts, params: GenerationParams, args, request=stream_request
) -> dict:
    """C threads, each: send a request, read its stream to the end, send the next
    (`request`: grpc_request.stream_request, or wait_request for Submit + WaitJob)."""
    schedule = Schedule(args.duration, args.requests, args.warmup)
    recs: list[Rec] = []
    with ThreadPoolExecutor(c) as pool:
        list(pool.map(lambda i: grpc_thread(address, params, schedule, recs, i, c, request,
                                            prompts), range(c)))  # fmt: skip
    stats = summarize(recs, schedule.window)
    stats["hops"] = hop_timings(address)
    print(f"  C={c} {params.mode}: {stats['tok_s']} tok/s, TTFT p50 {stats['ttft_ms_p50']} ms",
          file=sys.stderr)  # fmt: skip
    return stats


# ---- what the coordinator reports -------------------------------------------------------


def hop_timings(address: str) -> list[dict]:
    """Per worker, in layer order: the median layer compute and the median time from
    sending a micro-batch to its reply, over the coordinator's last 256 forwards."""
    with WedlmClient(address) as client:
        status = client.cluster_status()
    return [
        {"address": w.address, "layers": f"{w.info.layer_start}-{w.info.layer_end}",
         "compute_ms": round(w.timing.compute_s * 1e3, 3),
         "roundtrip_ms": round(w.timing.roundtrip_s * 1e3, 3)}
        for w in sorted(status.workers, key=lambda w: w.info.layer_start)
        if w.info.has_layers
    ]  # fmt: skip


def sweep(address: str, levels: list[int], prompts, params: GenerationParams, args) -> dict:
    return {str(c): grpc_level(address, c, prompts, params, args) for c in levels}


# ---- report --------------------------------------------------------------------------------
def targets(result: dict) -> dict:
    t: dict = {"required": TARGETS}
    if "pipeline" in result:
        t["pipeline_p_over_1"] = result["pipeline"]["ratio"]
    if "http_vs_grpc" in result:
        t["http_over_grpc_tok_s"] = {
            c: v["http_over_grpc_tok_s"] for c, v in result["http_vs_grpc"]["levels"].items()
        }
    return t


def run_cluster_phases(result: dict, model: Path, args) -> None:
    """(>= 2 workers) the largest level at 1 and at P micro-batches in flight, restarting
    the coordinator between them (the workers stay); then HTTP against gRPC."""
    levels, top = sorted(args.concurrency), max(args.concurrency)
    params = GenerationParams(mode=args.mode, max_tokens=args.max_tokens)
    cluster = Cluster(model, args.workers, top, gpus=args.gpus, local=args.local_layers)
    if "http" in args.phases:
        cluster.flags = ("--http-port", "0")
    try:
        if "pipeline" in args.phases and args.workers >= 2:
            result["pipeline"] = pipeline_rounds(cluster, top, params, args)
            save_json(result, args.out, "serve.partial.json")
        if "http" in args.phases:
            address = cluster.start_coordinator()
            url = http_url_of(cluster.coordinator.log)
            result["http_vs_grpc"] = http_vs_grpc(address, url, model.name, levels, params, args)
            save_json(result, args.out, "serve.partial.json")
    finally:
        cluster.stop()


def pipeline_rounds(cluster: Cluster, top: int, params: GenerationParams, args) -> dict:
    """1 vs P micro-batches in flight at the top level, alternated round by round. Kernels
    for new shapes compile on first use in each worker, so the level that runs first on a
    fresh cluster pays for them: with several rounds the first is a warm-up and the ratio is
    the median over the others."""
    rounds: list[dict] = []
    for _ in range(args.pipeline_rounds):
        runs = {}
        for p in (1, args.workers):
            address = cluster.start_coordinator(micro_batches=p)
            runs[str(p)] = grpc_level(address, top, PROMPTS, params, args)
        runs["ratio"] = ratio(runs[str(args.workers)]["tok_s"], runs["1"]["tok_s"])
        rounds.append(runs)
    counted = rounds[1:] if len(rounds) > 1 else rounds
    ratios = [r["ratio"] for r in counted if r["ratio"] is not None]
    return {
        "concurrency": top,
        "rounds": rounds,
        "micro_batches": counted[-1],
        "ratio": round(float(np.median(ratios)), 3) if ratios else None,
        "counted_rounds": len(counted),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_model_flags(ap)
    ap.add_argument(
        "--workers", type=int, default=1, help="0: the coordinator alone holds every layer"
    )
    ap.add_argument(
        "--local-layers",
        action="store_true",
        help="the coordinator holds the first of workers + 1 even ranges (default: none)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (not --duration)")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", choices=("wedlm", "ar"), default="ar")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    ap.add_argument("--gpus", type=int, default=0, help=GPUS_HELP)
    ap.add_argument(
        "--pipeline-rounds",
        type=int,
        default=2,
        help="rounds of (1, P) micro-batches in flight; the first is a warm-up",
    )
    ap.add_argument("--client-processes", type=int, default=4, help="http phase: load processes")
    ap.add_argument("--http-rounds", type=int, default=2, help="http phase: rounds per level")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = ap.parse_args()
    if args.pipeline_rounds < 1:
        ap.error("--pipeline-rounds must be at least 1")
    if args.requests:
        args.duration = 0.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups on a kill
    t_start = now()
    model, name = prepare_model(args)
    import mlx.core as mx

    result: dict = {
        "model": name, "device": device_name(), "mlx": mx.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"), "workers": args.workers, "mode": args.mode,
        "max_tokens": args.max_tokens, "prompts": len(PROMPTS), "warmup_s": args.warmup,
        "per_level": f"{args.requests} requests" if args.requests else f"{args.duration} s",
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    run_cluster_phases(result, model, args)
    result["targets"] = targets(result)
    result["total_s"] = round(now() - t_start, 1)
    plots = {"serve-http.png": plot_http} if "http_vs_grpc" in result else {}
    finish(result, args.out, "serve", plots)


if __name__ == "__main__":
    main()
