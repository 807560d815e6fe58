"""Cluster benchmark: (1) per-hop cost of hidden states through the full path (MLX array →
bytes → gRPC → worker → gRPC → bytes → MLX array) minus the worker's layer time, and
(2) single-stream decode step time with 1..N real `wedlm-worker` processes on this host
versus the single-process engine, interleaved in one run. Prints one JSON object and writes
cluster.json + cluster.png to --out.

  python benchmarks/dev/cluster.py --model default --tokens 16 --repeats 2
  python benchmarks/dev/cluster.py --model random-qwen3-8b \\
      [--layers-override 6 --hidden-override 256]

`random-qwen3-8b` writes a random bf16 Qwen3-8B-shaped checkpoint (config, a word-level
tokenizer covering the whole vocabulary, sharded safetensors + index) to --ckpt-dir once.
All processes run on this host (on a GPU machine they share the one GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the project root holds tests/ too
    sys.path.insert(0, str(ROOT))

from benchmarks.dev import grpc_floor
from benchmarks.dev.bench_cluster import GPUS_HELP, Cluster
from benchmarks.dev.bench_io import add_random_model_flags, finish, hidden_states, suptitled
from common.generation_params import GenerationParams
from common.model_config import load_model_config
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, encode_frame
from coordinator.cluster.worker_chain import forward_request
from coordinator.cluster.worker_link import WorkerLink
from coordinator.engine.local_engine import open_local_engine, resolve_model
from coordinator.service.results import result_record
from devtools.cluster_harness import cluster_name, start_worker
from devtools.random_checkpoints import QWEN3_8B, write_random_qwen3
from wedlm_client.client import WedlmClient

now = time.perf_counter
PAYLOADS = (16 * 1024, 256 * 1024, 4 * 1024 * 1024)
HOP_TARGET_MS = 0.5  # per-hop overhead at 256 KiB
PREFILL_ROWS = 512  # one prefill chunk
STEP_TARGET = 1.15  # 2 workers / single process
WINDOW = 16


# ---- (1) per-hop overhead -------------------------------------------------------------------
def payload_shape(nbytes: int, hidden: int) -> tuple[int, int]:
    rows = max(1, round(nbytes / (2 * hidden)))
    return (rows // WINDOW, WINDOW) if rows >= WINDOW and rows % WINDOW == 0 else (1, rows)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def bench_hops(model: Path, repeats: int, warmup: int) -> dict:
    config = load_model_config(model)
    proc, address = start_worker(model, cluster_name(), "--layers", "0-0", "--no-bonjour")
    link = WorkerLink(address, None, config.identity)
    results = {}
    try:
        info = link.info()
        pings = []
        for _ in range(50 + repeats):  # a unary call with no MLX work: gRPC's own floor
            t0 = now()
            link.info()
            pings.append(now() - t0)
        results["unary_info_ms_median"] = statistics.median(pings[50:]) * 1e3
        # grpcio's own floor: a raw-bytes stream echo between two processes, same sizes
        floor = grpc_floor.measure(list(PAYLOADS), repeats)
        for k, nbytes in enumerate(PAYLOADS):
            b, t, x, seq_ids = hidden_states(nbytes, config.hidden_size, payload_shape,
                                             10_000 * (k + 1))  # fmt: skip
            # committed 0 and keep 0: every forward is a fresh window, the KV stays empty
            spec = RowsSpec(
                seq_ids,
                np.zeros(b, np.int64),
                np.full(b, t, np.int64),
                np.ones((b, t), bool),
                np.zeros(b, np.int64),
            )
            n = repeats if nbytes < PAYLOADS[-1] else max(20, repeats // 2)
            rt, comp, enc, dec, wire, queue_s = [], [], [], [], [], []
            for r in range(warmup + n):
                t0 = now()
                request = forward_request(r + 1, spec, encode_frame(x))  # as the pipeline does
                t1 = now()
                link.send(request)
                reply = link.receive()
                t2 = now()
                y = decode(reply.hidden)
                mx.eval(y)
                t3 = now()
                if r >= warmup:
                    rt.append(t3 - t0)
                    comp.append(reply.compute_s)
                    enc.append(t1 - t0)
                    wire.append(t2 - t1 - reply.compute_s)
                    dec.append(t3 - t2)
                    queue_s.append(reply.queue_s)
            assert y.shape == x.shape and y.dtype == mx.bfloat16
            over = [a - c for a, c in zip(rt, comp, strict=True)]
            ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
            results[str(nbytes)] = {
                "shape": [b, t, config.hidden_size],
                "bytes": b * t * config.hidden_size * 2,
                "repeats": n,
                "overhead_ms_median": ms(over),
                "overhead_ms_p90": pct(over, 90) * 1e3,
                "roundtrip_ms_median": ms(rt),
                "compute_ms_median": ms(comp),
                "encode_ms_median": ms(enc),
                "send_to_reply_minus_compute_ms_median": ms(wire),
                "decode_ms_median": ms(dec),
                "worker_queue_ms_median": ms(queue_s),
                "grpc_stream_echo_ms_median": floor[str(nbytes)],
                "overhead_beyond_echo_ms_median": ms(over) - floor[str(nbytes)],
            }
            link.release(seq_ids)
        results["prefill_reply"] = prefill_reply(link, config.hidden_size, repeats, warmup)
        results["worker_device"] = info.device
        results["worker_dtype"] = info.hidden_dtype
    finally:
        link.close()
        proc.stop()
    return results


def prefill_reply(link: WorkerLink, hidden: int, repeats: int, warmup: int) -> dict:
    """A 512-row prefill chunk of one sequence through the worker, its reply carrying every
    row (as a middle worker's does, and as the last worker's did before protocol 2) versus
    only the last row (the one the head needs), alternated in one loop."""
    rows = PREFILL_ROWS
    x = (mx.random.normal((1, rows, hidden)) * 0.5).astype(mx.bfloat16)
    mx.eval(x)
    spec = RowsSpec(
        [90_000],
        np.zeros(1, np.int64),
        np.full(1, rows, np.int64),
        np.ones((1, rows), bool),
        np.zeros(1, np.int64),
    )  # keep 0: the KV stays empty, every forward is the same first chunk
    last = np.array([[rows - 1]], np.int32)
    times: dict[str, list[float]] = {"all_rows": [], "last_row": []}
    n = max(20, repeats // 2)
    for r in range(warmup + n):
        for kind, slots in (("all_rows", None), ("last_row", last)):
            t0 = now()
            link.send(forward_request(r + 1, spec, encode_frame(x), slots))
            reply = link.receive()
            mx.eval(decode(reply.hidden))
            if r >= warmup:
                times[kind].append((now() - t0) - reply.compute_s)
    link.release([90_000])
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "rows": rows,
        "request_bytes": rows * hidden * 2,
        "overhead_ms_median": out,
        "saved_ms": out["all_rows"] - out["last_row"],
        "repeats": n,
    }


# ---- (2) decode step: N workers vs the single-process engine -------------------------------
def local_generate(engine, prompt: list[int], params: GenerationParams) -> dict:
    seq = engine.submit(prompt, params)
    for _ in engine.stream([seq]):
        pass
    return result_record(seq, "").to_dict()  # as the cluster client's final_dict


def step_record(out: dict, n_tokens: int) -> dict:
    return {
        "step_ms": out["decode_s"] / max(out["forwards"], 1) * 1e3,
        "decode_s": out["decode_s"],
        "forwards": out["forwards"],
        "tokens": len(out["tokens"]),
        "finish_reason": out["finish_reason"],
        "full_length": out["finish_reason"] == "length" and len(out["tokens"]) == n_tokens,
    }


def bench_decode(
    model: Path,
    workers: list[int],
    repeats: int,
    n_tokens: int,
    deadline: float,
    partial,
    gpus: int = 0,
) -> dict:
    local = open_local_engine(model)
    vocab = local.engine.config.vocab_size  # ids 100..4999, within a tiny model's vocabulary
    ids = np.random.default_rng(1).integers(min(100, vocab // 10), min(vocab, 5000), 32)
    prompt = [int(t) for t in ids]
    modes = {
        m: GenerationParams(mode=m, window=WINDOW, max_tokens=n_tokens, temperature=0.0)
        for m in ("ar", "wedlm")
    }
    out: dict = {"prompt_tokens": len(prompt), "tokens": n_tokens, "phases": {}}
    for n in workers:
        if now() > deadline - 90:  # a phase needs its startup plus two rounds
            out["phases"][str(n)] = {"skipped": "time budget spent"}
            continue
        t_start = now()
        cluster = Cluster(model, n, gpus=gpus)
        runs: dict[str, dict[str, list[dict]]] = {m: {"single": [], "cluster": []} for m in modes}
        tokens_equal = {m: True for m in modes}
        client = None
        try:
            client = WedlmClient(cluster.start_coordinator())
            startup_s = now() - t_start
            for r in range(repeats + 1):  # round 0 warms up (and compiles) both sides
                if r > 1 and now() > deadline:
                    break
                for m, params in modes.items():
                    a = local_generate(local.engine, prompt, params)  # A
                    b = client.generate(ids=prompt, params=params)  # B
                    tokens_equal[m] &= a["tokens"] == b["tokens"]
                    if r:
                        runs[m]["single"].append(step_record(a, n_tokens))
                        runs[m]["cluster"].append(step_record(b, n_tokens))
        finally:
            if client is not None:
                client.close()
            cluster.stop()
        phase = {"ranges": cluster.ranges, "startup_s": startup_s, "repeats_done": 0}
        for m in modes:
            s, c = runs[m]["single"], runs[m]["cluster"]
            if not s:
                continue
            phase["repeats_done"] = len(s)
            med = lambda v, f: statistics.median(x[f] for x in v)  # noqa: E731
            phase[m] = {
                "single_step_ms": med(s, "step_ms"),
                "cluster_step_ms": med(c, "step_ms"),
                "ratio": med(c, "step_ms") / med(s, "step_ms"),
                "single_runs_ms": [x["step_ms"] for x in s],
                "cluster_runs_ms": [x["step_ms"] for x in c],
                "forwards": {"single": med(s, "forwards"), "cluster": med(c, "forwards")},
                "all_full_length": all(x["full_length"] for x in s + c),
                "finish_reasons": sorted({x["finish_reason"] for x in s + c}),
                "tokens_equal": tokens_equal[m],
            }
        out["phases"][str(n)] = phase
        partial(out)
    return out


# ---- output ---------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    hops = result.get("hops")
    if hops:
        sizes = [int(k) for k in hops if k.isdigit()]
        kib = [hops[str(s)]["bytes"] / 1024 for s in sizes]
        a.plot(kib, [hops[str(s)]["overhead_ms_median"] for s in sizes], "o-", label="median")
        a.plot(kib, [hops[str(s)]["overhead_ms_p90"] for s in sizes], "s--", label="p90")
        a.axhline(HOP_TARGET_MS, color="red", ls=":", label=f"{HOP_TARGET_MS} ms target")
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.legend()
    a.set(
        xlabel="bf16 hidden states per hop (KiB)",
        ylabel="roundtrip − worker compute (ms)",
        title="per-hop overhead",
    )
    dec = result.get("decode")
    if dec:
        for i, m in enumerate(("ar", "wedlm")):
            ns = [n for n, p in dec["phases"].items() if m in p]
            if not ns:
                continue
            single = statistics.median(dec["phases"][n][m]["single_step_ms"] for n in ns)
            b.plot(
                [int(n) for n in ns],
                [dec["phases"][n][m]["cluster_step_ms"] for n in ns],
                "o-",
                color=f"C{i}",
                label=f"{m}: cluster",
            )
            b.axhline(single, color=f"C{i}", ls=":", label=f"{m}: single process")
            b.axhline(
                STEP_TARGET * single,
                color=f"C{i}",
                ls="--",
                alpha=0.6,
                label=f"{m}: {STEP_TARGET}× single",
            )
        b.set_yscale("log")
        b.set_xticks([int(n) for n in dec["phases"]])
        b.legend(fontsize=8)
    b.set(
        xlabel="workers (one host)",
        ylabel="decode step ms (median)",
        title="single-stream decode step",
    )
    suptitled(fig, result, path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_model_flags(ap)
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="decode repeats (ABAB rounds)")
    ap.add_argument("--hop-repeats", type=int, default=200)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; 0 = none")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--skip-hops", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--gpus", type=int, default=0, help=GPUS_HELP)
    args = ap.parse_args()
    t0 = now()
    deadline = t0 + args.time_budget if args.time_budget else float("inf")
    if args.model == "random-qwen3-8b":
        layers = args.layers_override or QWEN3_8B["layers"]
        hidden = args.hidden_override or QWEN3_8B["hidden"]
        ckpt = args.ckpt_dir or Path(f"/tmp/wedlm-random-qwen3-8b-L{layers}-H{hidden}")
        model = write_random_qwen3(ckpt, layers, hidden)
        name = f"random-qwen3-8b(layers={layers},hidden={hidden},bf16)"
    else:
        model, name = resolve_model(args.model), args.model
    try:
        dev = mx.device_info().get("device_name", "")
    except Exception:  # not every backend reports it
        dev = ""
    result = {
        "model": name,
        "device": f"{mx.default_device()} {dev}".strip(),
        "mlx": mx.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "note": "all processes on one host; "
        + (f"workers spread over {args.gpus} GPUs" if args.gpus else "one device shared by all"),
        "setup_s": now() - t0,
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def partial(dec: dict) -> None:
        (args.out / "cluster.partial.json").write_text(json.dumps({**result, "decode": dec}))

    if not args.skip_hops:
        result["hops"] = bench_hops(model, args.hop_repeats, warmup=20)
        partial({})
    if not args.skip_decode:
        workers = [int(w) for w in args.workers.split(",")]
        result["decode"] = bench_decode(
            model, workers, args.repeats, args.tokens, deadline, partial, args.gpus
        )
    summary = {}
    if "hops" in result:
        h = result["hops"][str(256 * 1024)]
        summary["hop_256KiB_overhead_ms_median"] = h["overhead_ms_median"]
        summary["hop_256KiB_target_ms"] = HOP_TARGET_MS
    if "decode" in result:
        for n, p in result["decode"]["phases"].items():
            for m in ("ar", "wedlm"):
                if m in p:
                    summary[f"ratio_{n}w_{m}"] = p[m]["ratio"]
        summary["ratio_2w_target"] = STEP_TARGET
    result["summary"] = summary
    result["total_s"] = now() - t0
    finish(result, args.out, "cluster", {"cluster.png": plot})


if __name__ == "__main__":
    main()
