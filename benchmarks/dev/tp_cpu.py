"""Today's tensor groups against mlx-lm's TP on this CPU (issue 57, "Measurements"): one run,
one random Qwen3-like checkpoint (devtools/random_checkpoints.py), the ring backend on
127.0.0.1, one process per rank.

- mlx-lm: one process and TP = 2 under `mlx.launch --backend ring`, each rank `Model.shard`ed
  (benchmarks/dev/tp_gpu_ranks.py's `bench`): single stream = 1 / generate_step's tok/s
  (its async loop, first token to last), 8 rows = BatchGenerator's median step.
- ours: the coordinator alone (no TP) and TP = 2 (the coordinator leading a group with one
  worker, as tests/e2e/cluster/test_tensor_groups_e2e.py starts it), AR mode over gRPC:
  the median gap between a stream's committed-token events (per token) while every stream
  runs, past each stream's first SKIP events; single stream and 8 concurrent streams.
- MLX processes per member: the member's process and its children with libmlx mapped.
- bytes per decode step: the pipe frames between the coordinator and its group process,
  counted in the coordinator by a wrapper this script puts around common/tensor_group/
  wire.py's pack and read_body (no product change), and the ring's all_sum bytes per rank,
  estimated from the layout (ours: the 16 KiB message block, the confirming int32 and 2 per
  layer of rows x hidden bf16; mlx-lm: the layers' alone).

Medians; 2 shared cores are noisy. One JSON line; tp_cpu.json and .png in --out.

  python benchmarks/dev/tp_cpu.py --out /tmp/tpcpu          # about 5 minutes on 2 cores
  python benchmarks/dev/tp_cpu.py --quick --out /tmp/tpcpu  # a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the project root holds benchmarks/
    sys.path.insert(0, str(ROOT))

from benchmarks.dev import bench_io
from benchmarks.dev.bench_io import med, now, ratio

SKIP = 4  # first token events of a stream not measured (its prompt, new shapes)
SHARE_BLOCK = 16384  # common/tensor_group/process.py: the message block of each forward


# ---- the checkpoint ------------------------------------------------------------------------
def write_model(args) -> Path:
    from devtools.random_checkpoints import qwen3_config, write_random_checkpoint

    h = args.hidden
    heads = h // 128
    shape = dict(layers=args.layers, hidden=h, intermediate=3 * h, heads=heads,
                 kv_heads=max(1, heads // 4), head_dim=128, vocab=args.vocab)  # fmt: skip
    path = args.ckpt_dir or Path(f"/tmp/wedlm-tpcpu-L{args.layers}-H{h}-V{args.vocab}")
    return write_random_checkpoint(path, qwen3_config(shape))  # reused when complete


# ---- mlx-lm --------------------------------------------------------------------------------
def mlxlm(path: Path, tp: int, args) -> dict[str, Any]:
    from benchmarks.dev.tp_launch import run_task

    params = {"model": str(path), "what": ["decode", "batch"], "prompt": args.prompt,
              "tokens": args.tokens, "repeats": args.repeats, "concurrency": args.rows,
              "prefill": 1, "backend": "ring", "tp": tp}  # fmt: skip
    run = run_task("bench", params, tp, "ring", args.timeout)
    return {"single_ms": round(1e3 / run["decode"]["tok_s"], 3),
            f"rows{args.rows}_ms": round(args.rows * 1e3 / run["batch"]["tok_s"], 3),
            "run": run}  # fmt: skip


# ---- ours ----------------------------------------------------------------------------------
def counted_coordinator(frames: Path, argv: list[str]) -> int:
    """`wedlm-coordinator` with every pipe frame to and from its group process counted
    into `frames` (rewritten twice a second): wire.py's module-level pack and read_body
    are what write_frame and read_frame call."""
    from common.tensor_group import wire

    sent: list[list] = []  # [op, rows, width, bytes]
    received: list[int] = []
    pack, read_body = wire.pack, wire.read_body

    def counted_pack(message: dict[str, Any]) -> bytes:
        body = pack(message)
        shape = message["hidden"][1] if message.get("op") == "forward" else [0, 0]
        sent.append([message.get("op"), shape[0], shape[1], len(body) + 4])  # + its length
        return body

    def counted_read_body(src) -> bytes:
        body = read_body(src)
        received.append(len(body) + 4)
        return body

    def dump() -> None:
        while True:
            time.sleep(0.5)
            frames.write_text(json.dumps({"sent": list(sent), "received": list(received)}))

    wire.pack, wire.read_body = counted_pack, counted_read_body
    threading.Thread(target=dump, daemon=True).start()
    from coordinator.service.server_cli import main

    return main(argv)


def frames_seen(frames: Path) -> dict[str, list]:
    try:
        return json.loads(frames.read_text())
    except (OSError, ValueError):  # not written yet (no group) or mid-write
        return {"sent": [], "received": []}


def mlx_processes(pid: int) -> int:
    """The process and its children that have MLX's library mapped."""
    import psutil

    root = psutil.Process(pid)
    count = 0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            count += any("libmlx" in m.path for m in p.memory_maps())
    return count


def stream_gaps(address: str, prompts: list[list[int]], tokens: int) -> list[float]:
    """Seconds per token between consecutive token events of each stream, while every
    stream runs, past each stream's first SKIP events (AR mode, greedy)."""
    from common.generation_params import GenerationParams
    from wedlm_client.client import WedlmClient

    events: list[list[tuple[float, int]]] = [[] for _ in prompts]

    def run(i: int) -> None:
        with WedlmClient(address, timeout=600) as client:
            params = GenerationParams(mode="ar", max_tokens=tokens)
            for event in client.generate_stream(ids=prompts[i], params=params):
                if event[0] == "tokens":
                    events[i].append((now(), len(event[1])))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = [e for e in events if len(e) > SKIP + 1]
    if not kept:
        return []
    start = max(e[SKIP][0] for e in kept)  # every stream past its first events
    end = min(e[-1][0] for e in kept)  # until the first one ends
    return [(b[0] - a[0]) / b[1] for e in kept for a, b in itertools.pairwise(e)
            if a[0] >= start and b[0] <= end]  # fmt: skip


def ours(path: Path, tp: int, args, single: list[int], rows: list[list[int]]) -> dict[str, Any]:
    from devtools.cluster_harness import cluster_name, spawn_command, start_worker

    name = cluster_name()
    frames = args.out / f"tp_cpu-frames-tp{tp}.json"
    frames.unlink(missing_ok=True)
    procs, extra = [], []
    try:
        if tp > 1:
            worker, addr = start_worker(path, name, "--no-bonjour")
            procs.append(worker)
            extra = ["--worker", addr, "--expect", "1", "--tp", str(tp)]
        argv = [sys.executable, str(Path(__file__).resolve()), "--counted-coordinator",
                str(frames), "serve", "--model", str(path), "--port", "0", "--cluster", name,
                "--state-dir", "none", "--no-bonjour", *extra]  # fmt: skip
        coord = spawn_command(argv)
        procs.append(coord)
        address = coord.expect(r"listening on (127\.0\.0\.1:\d+)", timeout=300).group(1)
        coord.expect("serving", timeout=300)
        out: dict[str, Any] = {"mlx_processes": {"coordinator": mlx_processes(coord.popen.pid)}}
        if tp > 1:
            out["mlx_processes"]["worker"] = mlx_processes(worker.popen.pid)
        stream_gaps(address, rows, SKIP + 4)  # warm-up: new shapes, unmeasured
        gaps = {"single": [], f"rows{len(rows)}": []}
        per_step: dict[str, dict] = {}
        for _ in range(args.repeats):
            for key, prompts in (("single", [single]), (f"rows{len(rows)}", rows)):
                time.sleep(0.6)  # the counter's next dump: every answer of the last phase in
                before = frames_seen(frames)
                gaps[key] += stream_gaps(address, prompts, args.tokens)
                time.sleep(0.6)
                per_step[key] = step_frames(before, frames_seen(frames), len(prompts))
        for key, g in gaps.items():
            out[f"{key}_ms"] = med([1e3 * x for x in g], 3)
            out[f"{key}_gaps"] = len(g)
        if tp > 1:
            out["pipe_bytes_per_decode_step"] = per_step
        return out
    finally:
        for p in reversed(procs):
            p.stop()


def step_frames(before: dict, after: dict, streams: int) -> dict[str, Any]:
    """Pipe bytes per decode step (every stream one token) of a phase: its one-wide
    forwards (a step may be several, one per micro-batch) and their answers: past the
    group's start (one message, two answers), the i-th frame read answers the i-th sent."""
    sent = after["sent"][len(before["sent"]) :]
    received = after["received"][len(before["received"]) :]
    decode = [i for i, f in enumerate(sent) if f[0] == "forward" and f[2] == 1]
    steps = sum(sent[i][1] for i in decode) / streams
    if not steps or len(received) != len(sent):
        return {"decode_forwards": len(decode), "note": "no decode forwards, or answers missing"}
    return {"steps": round(steps, 1), "forwards_per_step": round(len(decode) / steps, 2),
            "sent_per_step": round(sum(sent[i][3] for i in decode) / steps),
            "received_per_step": round(sum(received[i] for i in decode) / steps),
            "other_frames": len(sent) - len(decode)}  # fmt: skip


def ring_bytes(path: Path, rows: int) -> dict[str, int]:
    """Estimated all_sum bytes each rank sends per decode step of `rows` rows (a ring of 2
    sends N bytes per all_sum of N: half in the reduce-scatter, half in the gather)."""
    cfg = json.loads((path / "config.json").read_text())
    layers = 2 * cfg["num_hidden_layers"] * rows * cfg["hidden_size"] * 2  # o_proj, down_proj
    return {"mlx_lm": layers, "ours": layers + SHARE_BLOCK + 4}


# ---- report --------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    plt = bench_io.pyplot()
    if plt is None:
        return
    keys = ["single_ms", f"rows{result['rows']}_ms"]
    runs = [("mlx-lm one", "mlxlm_one"), ("mlx-lm TP 2", "mlxlm_tp2"), ("ours one", "ours_one"),
            ("ours TP 2", "ours_tp2")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, key) in enumerate(runs):
        ys = [result[key].get(k) or 0 for k in keys]
        ax.bar([j + 0.2 * i - 0.3 for j in range(len(keys))], ys, 0.2, label=label)
    ax.set_xticks(range(len(keys)), ["single stream", f"{result['rows']} rows"])
    bench_io.finish_axes(ax, "", "ms per decode step (median)")
    bench_io.suptitled(fig, result, path, 120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--counted-coordinator"]:  # the coordinator process of `ours`
        return counted_coordinator(Path(argv[1]), argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024, help="heads of 128: >= 1024 splits")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ckpt-dir", type=Path)
    ap.add_argument("--prompt", type=int, default=32, help="single-stream prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per stream")
    ap.add_argument("--rows", type=int, default=8, help="concurrent streams")
    ap.add_argument("--repeats", type=int, default=1, help="measured runs after a warm-up")
    ap.add_argument("--timeout", type=float, default=300.0, help="s for each mlx-lm run")
    ap.add_argument("--quick", action="store_true", help="2 layers, 16 tokens, 1 repeat")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.repeats = 2, 16, 1
    if args.tokens < SKIP + 3 or args.rows < 1 or args.repeats < 1:
        ap.error(f"--tokens >= {SKIP + 3}, --rows and --repeats >= 1")
    from benchmarks.dev.tp_gpu_ranks import prompt, prompts_for

    args.out.mkdir(parents=True, exist_ok=True)  # the frame counts go there too
    path = write_model(args)
    name = f"random qwen3 (layers={args.layers}, hidden={args.hidden}, vocab={args.vocab}, bf16)"
    result = bench_io.run_info(model=name, model_path=str(path), rows=args.rows,
                               tokens=args.tokens, repeats=args.repeats)  # fmt: skip
    single = prompt(args.prompt, args.vocab, 1).tolist()  # the prompts mlx-lm's ranks use
    rows = prompts_for(args.rows, args.vocab)
    for key, run in (("mlxlm_one", lambda: mlxlm(path, 1, args)),
                     ("mlxlm_tp2", lambda: mlxlm(path, 2, args)),
                     ("ours_one", lambda: ours(path, 1, args, single, rows)),
                     ("ours_tp2", lambda: ours(path, 2, args, single, rows))):  # fmt: skip
        t0 = now()
        result[key] = run()
        bench_io.log(f"{key} ({now() - t0:.0f} s): {json.dumps(result[key])[:300]}", "tp_cpu")
    step_keys = ["single_ms", f"rows{args.rows}_ms"]
    result["ours_tp2_over_mlxlm_tp2"] = {
        k: ratio(result["ours_tp2"][k], result["mlxlm_tp2"][k]) for k in step_keys
    }
    result["tp2_over_one"] = {
        who: {k: ratio(result[f"{who}_tp2"][k], result[f"{who}_one"][k]) for k in step_keys}
        for who in ("ours", "mlxlm")
    }
    result["ring_bytes_per_decode_step_estimate"] = {
        "single": ring_bytes(path, 1),
        f"rows{args.rows}": ring_bytes(path, args.rows),
    }
    result["how"] = ("step ms: mlx-lm 1/generate_step tok/s (single) and BatchGenerator's "
                     "median step (rows); ours the median per-token gap of committed-token "
                     "events over gRPC, AR mode, while every stream runs")  # fmt: skip
    bench_io.finish(result, args.out, "tp_cpu", {"tp_cpu.png": plot})
    return 0


if __name__ == "__main__":
    sys.exit(main())
