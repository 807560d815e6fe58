"""Cluster benchmark: the per-hop cost of hidden states through the full path (MLX array →
bytes → gRPC → worker → gRPC → bytes → MLX array) minus the worker's layer time, against
grpcio's own echo (grpc_floor.py), and a prefill chunk's reply. Prints one JSON object and
writes cluster.json + cluster.png to --out. The single-stream decode step with 1..N workers
(run K1, history only) left with issue 55 (`git log -S bench_decode` finds it);
--skip-decode is still accepted, as K5's command passes it.

  python benchmarks/dev/cluster.py --model random-qwen3-8b \\
      [--layers-override 6 --hidden-override 256]

`random-qwen3-8b` writes a random bf16 Qwen3-8B-shaped checkpoint (config, a word-level
tokenizer covering the whole vocabulary, sharded safetensors + index) to --ckpt-dir once.
All processes run on this host (on a GPU machine they share the one GPU).
"""

from __future__ import annotations

import argparse
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
from benchmarks.dev.bench_io import (
    add_random_model_flags,
    device_name,
    finish,
    hidden_states,
    prepare_model,
    suptitled,
)
from common.model_config import load_model_config
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, encode_frame
from coordinator.cluster.worker_chain import forward_request
from coordinator.cluster.worker_link import WorkerLink
from devtools.cluster_harness import cluster_name, start_worker

now = time.perf_counter
PAYLOADS = (16 * 1024, 256 * 1024, 4 * 1024 * 1024)
HOP_TARGET_MS = 0.5  # per-hop overhead at 256 KiB
PREFILL_ROWS = 512  # one prefill chunk
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


# ---- output ---------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, a = plt.subplots(1, 1, figsize=(6, 4.5))
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
    suptitled(fig, result, path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_model_flags(ap)
    ap.add_argument("--hop-repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--skip-decode", action="store_true", help="accepted: nothing else runs")
    args = ap.parse_args()
    t0 = now()
    model, name = prepare_model(args)
    result = {
        "model": name,
        "device": device_name(),
        "mlx": mx.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "note": "all processes on one host; one device shared by all",
        "setup_s": now() - t0,
    }
    result["hops"] = bench_hops(model, args.hop_repeats, warmup=20)
    h = result["hops"][str(256 * 1024)]
    result["summary"] = {
        "hop_256KiB_overhead_ms_median": h["overhead_ms_median"],
        "hop_256KiB_target_ms": HOP_TARGET_MS,
    }
    result["total_s"] = now() - t0
    finish(result, args.out, "cluster", {"cluster.png": plot})


if __name__ == "__main__":
    main()
