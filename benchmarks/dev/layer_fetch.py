"""Layer fetch benchmark: how fast workers take their layers from the coordinator, and what
a cluster started from empty worker caches pays before its first token. Prints one JSON
object and writes layer_fetch.json + layer_fetch.png to --out.

  python benchmarks/dev/layer_fetch.py                    # ~2 GB of layers (20 × 96 MB, bf16)
  python benchmarks/dev/layer_fetch.py --layers 4 --hidden 512 --repeats 1   # a smoke run

(1) Throughput on loopback, medians of --repeats, side by side in one run:
    - a raw copy of the checkpoint's weight files on the same disk (shutil.copyfile);
    - one worker's fetch of every layer (the worker's own LayerFetcher against a running
      coordinator's ModelSource: gRPC, checksums, `.part` files, rename);
    - two workers fetching half each at the same time (aggregate MB/s).
    Both read the checkpoint from the page cache after the first round; the raw copy is
    the disk's and the OS's ceiling, not a network's.
(2) Time to first token of a cluster (coordinator without layers + 2 workers) started from
    empty worker caches, against the same cluster whose workers have the model folder
    (each --ttft-rounds times, in ABBA order; medians).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the project root holds tests/ too
    sys.path.insert(0, str(ROOT))

from common.checkpoint_weights import weight_files
from common.layer_range import LayerRange
from common.model_config import load_model_config
from coordinator.model_source.layer_files import LayerFiles
from devtools.cluster_harness import (
    cluster_name,
    start_coordinator,
    start_fetching_worker,
    start_worker,
)
from devtools.random_checkpoints import write_random_qwen3
from shard_worker.fetch_bench import fetch_s, raw_copy_s
from wedlm_client.client import WedlmClient

now = time.perf_counter
SECRET = "bench-secret"


def throughput(model: Path, repeats: int, scratch: Path) -> dict:
    config = load_model_config(model)
    files = LayerFiles(model, config.num_layers)
    layer_bytes = sum(files[i].size for i in range(config.num_layers))
    half = config.num_layers // 2
    whole = [LayerRange(0, config.num_layers - 1)]
    halves = [LayerRange(0, half - 1), LayerRange(half, config.num_layers - 1)]
    coord, address = start_coordinator(
        model, cluster_name(), "--no-bonjour", "--no-local-layers", "--secret", SECRET
    )  # waits for workers forever; its ModelSource serves from the start
    rounds: dict[str, list[float]] = {"raw_copy": [], "fetch_1": [], "fetch_2": []}
    try:
        fetch_s(address, config.identity, whole, scratch, SECRET)  # hashes; fills the page cache
        for _ in range(repeats):  # interleaved, so that drift hits all three alike
            s, copied = raw_copy_s(model, scratch)
            rounds["raw_copy"].append(copied / s / 1e6)
            for key, ranges in (("fetch_1", whole), ("fetch_2", halves)):
                s = fetch_s(address, config.identity, ranges, scratch, SECRET)[0]
                rounds[key].append(layer_bytes / s / 1e6)
    finally:
        coord.stop()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    return {
        "layer_bytes": layer_bytes,
        "checkpoint_bytes": sum(f.stat().st_size for f in weight_files(model)),
        "mb_per_s": {k: {"median": med[k], "rounds": v} for k, v in rounds.items()},
        "fetch_1_vs_raw_copy": med["fetch_1"] / med["raw_copy"],
        "fetch_2_vs_raw_copy": med["fetch_2"] / med["raw_copy"],
    }


def component_rates(model: Path, scratch: Path) -> dict[str, float]:
    """MB/s of each step a fetched byte goes through, alone on one thread: where a fetch's
    time goes (the coordinator reads; gRPC carries protobuf messages; the worker writes and
    hashes)."""
    import hashlib

    from common.proto_gen import wedlm_pb2 as pb

    config = load_model_config(model)
    files = LayerFiles(model, config.num_layers)
    layers = range(min(4, config.num_layers))
    pieces = [data for i in layers for _, data in files.chunks(i)]
    nbytes = sum(len(d) for d in pieces)
    rates = {}
    t0 = now()
    for i in layers:
        for _ in files.chunks(i):
            pass
    rates["read_layer_files"] = nbytes / (now() - t0) / 1e6
    t0 = now()
    for d in pieces:
        pb.LayerChunk.FromString(pb.LayerChunk(offset=1, data=d).SerializeToString())
    rates["protobuf_round_trip"] = nbytes / (now() - t0) / 1e6
    digest = hashlib.sha256()
    t0 = now()
    for d in pieces:
        digest.update(d)
    rates["sha256"] = nbytes / (now() - t0) / 1e6
    t0 = now()
    with open(scratch / "write-probe", "wb") as out:
        for d in pieces:
            out.write(d)
    rates["write_file"] = nbytes / (now() - t0) / 1e6
    (scratch / "write-probe").unlink()
    return rates


def first_token_s(model: Path, fetching: bool, scratch: Path) -> dict:
    """From launching 2 workers and a coordinator to the first streamed token."""
    name = cluster_name()
    env = {"WEDLM_SECRET": SECRET}
    t0 = now()
    procs, listed = [], []
    for i in range(2):
        if fetching:
            proc, address = start_fetching_worker(name, scratch / f"ttft-{i}", env=env)
        else:
            proc, address = start_worker(model, name, "--no-bonjour", env=env)
        procs.append(proc)
        listed += ["--worker", address]
    coord, address = start_coordinator(
        model, name, "--no-bonjour", "--no-local-layers", "--expect", "2", "--secret", SECRET,
        "--warm-up", "off", *listed,
    )  # fmt: skip
    procs.append(coord)
    try:
        coord.expect("serving", timeout=1800)
        ready = now() - t0
        with WedlmClient(address, timeout=600) as client:
            for event in client.generate_stream(text="w5 w6 w7", params=None):
                if event[0] == "tokens":
                    break
        first = now() - t0
    finally:
        for p in procs:
            p.stop()
    return {"ready_s": ready, "first_token_s": first}


def first_tokens(model: Path, rounds: int, scratch: Path) -> dict:
    """Both starts `rounds` times in ABBA order (the first start on a fresh machine also
    pays MLX's kernel compilation, which later starts find cached): medians."""
    runs: dict[str, list[dict]] = {"local_model": [], "empty_caches": []}
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for fetching in order:
            key = "empty_caches" if fetching else "local_model"
            runs[key].append(first_token_s(model, fetching, scratch))
            shutil.rmtree(scratch / "ttft-0", ignore_errors=True)
            shutil.rmtree(scratch / "ttft-1", ignore_errors=True)
    out: dict = {}
    for key, values in runs.items():
        out[key] = {
            name: statistics.median(v[name] for v in values)
            for name in ("ready_s", "first_token_s")
        }
        out[key]["rounds"] = values
    out["empty_vs_local"] = (
        out["empty_caches"]["first_token_s"] / out["local_model"]["first_token_s"]
    )
    out["ready_empty_minus_local_s"] = (
        out["empty_caches"]["ready_s"] - out["local_model"]["ready_s"]
    )
    return out


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    rates = result["throughput"]["mb_per_s"]
    labels = ["raw file copy", "fetch, 1 worker", "fetch, 2 workers"]
    a.bar(labels, [rates[k]["median"] for k in ("raw_copy", "fetch_1", "fetch_2")])
    a.set_ylabel("MB/s (median)")
    a.set_title(f"{result['throughput']['layer_bytes'] / 1e9:.1f} GB of layers, loopback")
    t = result.get("first_token")
    if t is None:
        b.axis("off")
        fig.savefig(out / "layer_fetch.png", dpi=120)
        return
    b.bar(["workers with the model", "workers fetching"],
          [t["local_model"]["first_token_s"], t["empty_caches"]["first_token_s"]])  # fmt: skip
    b.set_ylabel("s from launch to first token")
    b.set_title("cluster start: coordinator + 2 workers")
    fig.suptitle(result["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "layer_fetch.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ckpt-dir", type=Path, help="where the random checkpoint is written")
    ap.add_argument("--scratch", type=Path, help="where copies and caches go (default: /tmp)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--skip-first-token", action="store_true", help="only the throughput")
    ap.add_argument("--ttft-rounds", type=int, default=2, help="ABBA rounds of cluster starts")
    args = ap.parse_args()
    import mlx.core as mx

    ckpt = args.ckpt_dir or Path(tempfile.gettempdir()) / (
        f"wedlm-random-qwen3-L{args.layers}-H{args.hidden}"
    )
    model = write_random_qwen3(ckpt, args.layers, args.hidden)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        scratch = Path(tmp)
        result = {
            "model": f"random qwen3 (layers={args.layers}, hidden={args.hidden}, bf16)",
            "device": str(mx.default_device()),
            "date": time.strftime("%Y-%m-%d"),
            "throughput": throughput(model, args.repeats, scratch),
            "components_mb_per_s": component_rates(model, scratch),
        }
        if not args.skip_first_token:
            result["first_token"] = first_tokens(model, args.ttft_rounds, scratch)
    (args.out / "layer_fetch.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, args.out)
    except ImportError:
        result["plot"] = "matplotlib missing"
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
