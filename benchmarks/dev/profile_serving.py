"""Where a serving coordinator's time goes under load: the coordinator alone (every layer
in-process) serves a closed loop of C gRPC streams (benchmarks/dev/serve.py's), and py-spy
samples it twice: every thread's stacks, then only the thread holding the GIL (`--gil`).
Prints one JSON object (per thread: share of samples; the heaviest frames, self and
inclusive) and writes it with the raw collapsed stacks to --out.

Needs py-spy (`pip install py-spy`); it attaches to the coordinator's process id.

  python benchmarks/dev/profile_serving.py --model random-qwen3-8b --concurrency 32 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_cluster import Cluster
from benchmarks.dev.serve import grpc_level, prepare_model
from benchmarks.dev.serve_mlxlm import PROMPTS
from common.generation_params import GenerationParams
from wedlm_client.bench.clients import stream_request, wait_request


def parse_raw(path: Path) -> list[tuple[str, list[str], int]]:
    """py-spy's raw (collapsed) output: (thread, frames outermost first, samples)."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = "?"
        if frames and frames[0].startswith("process "):
            frames = frames[1:]
        if frames and frames[0].startswith("thread "):
            thread = frames[0]
            frames = frames[1:]
        out.append((thread, frames, int(count)))
    return out


def summarize(stacks: list[tuple[str, list[str], int]], top: int) -> dict:
    total = sum(n for _, _, n in stacks) or 1
    threads: Counter = Counter()
    own: Counter = Counter()
    inclusive: Counter = Counter()
    for thread, frames, n in stacks:
        threads[thread] += n
        if frames:
            own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n

    def share(c: Counter) -> list[tuple[str, float]]:
        return [(k, round(v / total, 4)) for k, v in c.most_common(top)]

    return {
        "samples": total,
        "threads": share(threads),
        "self": share(own),
        "inclusive": share(inclusive),
    }


def record(py_spy: str, pid: int, seconds: float, rate: int, out: Path, gil: bool) -> dict:
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
           "--rate", str(rate), "--format", "raw", "--threads", "--nonblocking",
           "--output", str(out)] + (["--gil"] if gil else [])  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        return {"error": f"cannot run py-spy: {e}", "command": shlex.join(cmd)}
    if done.returncode != 0 or not out.exists():
        return {"error": (done.stderr or done.stdout)[-2000:], "command": shlex.join(cmd)}
    return {"command": shlex.join(cmd)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-qwen3-8b")
    ap.add_argument("--ckpt-dir", type=Path)
    ap.add_argument("--layers-override", type=int, default=0)
    ap.add_argument("--hidden-override", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", choices=("ar", "wedlm"), default="ar")
    ap.add_argument("--warmup", type=float, default=8.0, help="load before sampling starts")
    ap.add_argument("--seconds", type=float, default=10.0, help="per recording")
    ap.add_argument("--rate", type=int, default=250, help="samples per second")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument(
        "--client",
        choices=("stream", "wait"),
        default="stream",
        help="stream: Generate streams; wait: Submit + WaitJob (no per-commit messages)",
    )
    ap.add_argument("--coordinator-flags", default="")
    ap.add_argument("--coordinator-env", nargs="*", default=[], help="KEY=VALUE for it")
    beside = Path(sys.executable).with_name("py-spy")  # installed in this environment
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or str(beside))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = ap.parse_args()
    args.requests = 0
    args.out.mkdir(parents=True, exist_ok=True)
    model, name = prepare_model(args)
    cluster = Cluster(model, 0, args.concurrency, local=True)
    cluster.flags = tuple(shlex.split(args.coordinator_flags))
    result: dict = {"model": name, "concurrency": args.concurrency, "mode": args.mode,
                    "client": args.client, "coordinator_flags": args.coordinator_flags,
                    "coordinator_env": args.coordinator_env,
                    "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    try:
        env = dict(kv.split("=", 1) for kv in args.coordinator_env)
        address = cluster.start_coordinator(env=env)
        result["startup"] = cluster.startup
        pid = cluster.coordinator.popen.pid
        # the load runs through both recordings, after its own warm-up
        args.duration = 2 * args.seconds + 6
        params = GenerationParams(mode=args.mode, max_tokens=args.max_tokens)
        load: dict = {}
        request = stream_request if args.client == "stream" else wait_request
        loader = threading.Thread(
            target=lambda: load.update(
                grpc_level(address, args.concurrency, PROMPTS, params, args, request)
            )
        )
        loader.start()
        time.sleep(args.warmup + 1)
        for label, gil in (("threads", False), ("gil", True)):
            raw = args.out / f"profile-{label}.txt"
            result[label] = record(args.py_spy, pid, args.seconds, args.rate, raw, gil)
            if raw.exists():
                result[label].update(summarize(parse_raw(raw), args.top))
        loader.join()
        result["load"] = {k: load.get(k) for k in ("tok_s", "ttft_ms_p50", "tpot_ms_p50")}
    finally:
        if cluster.coordinator is not None:  # what it said last (why it ended, if it did)
            result["coordinator_log"] = "".join(cluster.coordinator.log[-60:])[-6000:]
            result["coordinator_exit"] = cluster.coordinator.popen.poll()
        cluster.stop()
    (args.out / "profile_serving.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
