"""`wedlm bench fetch`: how fast a worker takes its layers from a coordinator (the worker's
own LayerFetcher: gRPC, checksums, `.part` files, rename) against a raw copy of weight
files on this disk (the disk's and the OS's ceiling). Needs the server install."""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from common.errors import WedlmError
from wedlm_client.bench.records import median, now
from wedlm_client.bench.report import Progress, emit, figure, header, save_figure, table


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def raw_copy_s(model: Path, scratch: Path) -> tuple[float, int]:
    """Seconds to copy the checkpoint's weight files, and their bytes."""
    from common.checkpoint_weights import weight_files

    target = scratch / "copy"
    target.mkdir()
    nbytes = 0
    t0 = now()
    for f in weight_files(model):
        shutil.copyfile(f, target / f.name)
        nbytes += f.stat().st_size
    elapsed = now() - t0
    shutil.rmtree(target)
    return elapsed, nbytes


def fetch_s(source: str, identity: str, ranges: list, scratch: Path, secret: str | None,
            tls=None) -> tuple[float, int]:  # fmt: skip
    """Seconds for len(ranges) fetchers (one per LayerRange, each with its own empty cache)
    to finish, all started together, and the bytes they wrote."""
    from shard_worker.layer_cache import LayerCache
    from shard_worker.layer_fetch import LayerFetcher

    fetchers = [LayerFetcher(LayerCache(scratch / f"cache-{i}"), secret, tls, f"bench-{i}")
                for i in range(len(ranges))]  # fmt: skip
    errors: list[BaseException] = []

    def run(fetcher, layers) -> None:
        try:
            fetcher.fetch(source, identity, layers)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f, r))
               for f, r in zip(fetchers, ranges, strict=True)]  # fmt: skip
    t0 = now()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = now() - t0
    if errors:
        raise errors[0]
    nbytes = 0
    for i in range(len(ranges)):
        nbytes += _tree_bytes(scratch / f"cache-{i}")
        shutil.rmtree(scratch / f"cache-{i}")
    return elapsed, nbytes


def run(args) -> dict[str, Any]:
    from common.layer_range import LayerRange
    from wedlm_client.bench.report import cluster_label

    label = cluster_label(args.cluster)
    if "error" in label:
        raise WedlmError(f"cannot read the cluster at {args.cluster}: {label['error']}")
    from wedlm_client.client import WedlmClient

    with WedlmClient(args.cluster, 10.0) as client:
        info = client.model_info()
    layers = LayerRange.parse(args.layers) if args.layers else LayerRange(0, info.num_layers - 1)
    result = header(
        "fetch",
        {
            "cluster": args.cluster,
            "layers": str(layers),
            "copy_from": str(args.copy_from),
            "repeats": args.repeats,
        },
    )
    result["cluster"] = label
    rounds: dict[str, list[float]] = {"fetch": [], "raw_copy": []}
    progress = Progress(args.repeats * (1 + bool(args.copy_from)), "fetch")
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        scratch = Path(tmp)
        for r in range(args.repeats):  # interleaved, so that drift hits both alike
            s, n = fetch_s(args.cluster, info.model_identity, [layers], scratch, args.secret)
            rounds["fetch"].append(n / s / 1e6)
            progress.step(f"round {r + 1}: fetch {n / 1e6:.0f} MB at {n / s / 1e6:.0f} MB/s")
            if args.copy_from:
                s, n = raw_copy_s(args.copy_from, scratch)
                rounds["raw_copy"].append(n / s / 1e6)
                progress.step(f"round {r + 1}: raw copy {n / 1e6:.0f} MB at "
                              f"{n / s / 1e6:.0f} MB/s")  # fmt: skip
    med = {k: median(v) for k, v in rounds.items()}
    result["mb_per_s"] = {k: {"median": med[k], "rounds": v} for k, v in rounds.items() if v}
    result["fetch_vs_raw_copy"] = (round(med["fetch"] / med["raw_copy"], 3)
                                   if med["raw_copy"] else None)  # fmt: skip
    rows = [[k, med[k], len(v)] for k, v in rounds.items() if v]
    text = table(["what", "MB/s (median)", "rounds"], rows)
    if result["fetch_vs_raw_copy"]:
        text += f"\nfetch / raw copy: {result['fetch_vs_raw_copy']}"
    result["files"] = {}
    made = figure(1, f"layers {layers} of {info.model_name} from {args.cluster}")
    if made is not None:
        fig, (ax,) = made
        ax.bar([r[0] for r in rows], [r[1] for r in rows])
        ax.set_ylabel("MB/s (median)")
        result["files"]["png"] = save_figure(fig, args.out / "fetch.png")
    emit(result, text, args.out, "fetch", args.json)
    return result


def main() -> int:
    """`python -m shard_worker.fetch_bench bench fetch ...`: what `wedlm bench fetch` runs
    (the client's parser; the worker's fetcher)."""
    from wedlm_client.cli import build_parser

    args = build_parser().parse_args(sys.argv[1:])
    try:
        run(args)
    except WedlmError as e:
        print(f"wedlm: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
