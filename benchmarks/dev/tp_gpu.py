"""Tensor parallelism on two GPUs (issue 32): one GPU against TP = 2 over mlx.distributed,
in phases that run on their own (a GPU call is limited to 10 minutes):

  make-model  a random bf16 checkpoint of Qwen3-8B or -32B shape (devtools/
              random_checkpoints.py; --layers-override for a shorter one): its time and size,
              and the time the whole model would take at that rate (drawing the weights
              costs on a CPU, ~0.025 GB/s on 2 shared cores; on a GPU the disk's ~0.4 GB/s
              sets it: ~40 s for 8B, 16.4 GB, ~165 s for 32B, 66 GB)
  mlxlm       mlx-lm alone on GPU 0 against mlx-lm's TP = 2 (`sharded_load`, i.e.
              `Model.shard`) under `mlx.launch --backend nccl` (ring on a CPU): single-stream
              decode tok/s, C-stream aggregate decode tok/s (BatchGenerator), prefill of P
              tokens; medians over --repeats in each process, TP / one side by side
  profile     where a TP decode step goes: the step built and evaluated synchronously, one
              GPU, TP = 2, TP = 2 with every all_sum replaced by the identity (each rank's
              compute alone), and the all_sums alone in a chain (tp_gpu_ranks.py says how)
  servers     `mlx_lm.server` as TP ranks under mlx.launch against our cluster started
              from --ours-cmd templates (tp_gpu_servers.py), over HTTP with the `openai`
              package at each --concurrency, one server up at a time (serve_openai.py)

Each run prints one JSON object and writes tp_gpu-PHASES.json and .png to --out (and a
.partial.json after each phase). --model is a checkpoint folder or random-qwen3-8b /
random-qwen3-32b (written first, once, to --ckpt-dir or /tmp/wedlm-random-SHAPE-L*-H*).

GPU (nvidia-h200-x2), one call each; 32B at full depth needs about 66 GB of disk:
  python benchmarks/dev/tp_gpu.py make-model --model random-qwen3-8b --out $OUT
  python benchmarks/dev/tp_gpu.py mlxlm profile --model random-qwen3-8b --out $OUT
  python benchmarks/dev/tp_gpu.py servers --model random-qwen3-8b --ours tp2 --out $OUT
CPU dry run (ring over 127.0.0.1; hidden 1024 so that the tiny shape's 2 KV heads split):
  python benchmarks/dev/tp_gpu.py make-model mlxlm profile servers --model random-qwen3-8b \\
      --layers-override 2 --hidden-override 1024 --tokens 12 --batch 4 --prefill 256 \\
      --context 64 --steps 4 --concurrency 1 4 --duration 20 --warmup 2 --max-tokens 8 \\
      --out /tmp/tpg
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the project root holds benchmarks/, tests/
    sys.path.insert(0, str(ROOT))

from benchmarks.dev import bench_io
from benchmarks.dev.bench_io import now, ratio
from benchmarks.dev.tp_shapes import SHAPES, VOCAB, layer_params

PHASES = ("make-model", "mlxlm", "profile", "servers")
RANDOM = {f"random-{name}": name for name in SHAPES}
# issue 32's targets for ours; mlx-lm's TP = 2 measured for reference on 2 H200s
TARGETS = {"decode_32b": 1.0, "prefill_32b": 1.75, "batch_32b": 1.3,
           "mlx_lm_reference": {"decode": "0.49x (8B), 0.71-0.77x (32B)",
                                "prefill": "1.50-1.75x"}}  # fmt: skip


# ---- the model -----------------------------------------------------------------------------
def model_spec(args) -> tuple[Path, str, str | None, int, int]:
    """(path, name, shape or None, layers, hidden) of --model."""
    if args.model not in RANDOM:
        return Path(args.model), args.model, None, 0, 0
    shape = RANDOM[args.model]
    layers = args.layers_override or SHAPES[shape]["layers"]
    hidden = args.hidden_override or SHAPES[shape]["hidden"]
    path = args.ckpt_dir or Path(tempfile.gettempdir()) / f"wedlm-{args.model}-L{layers}-H{hidden}"
    return path, f"{args.model}(layers={layers},hidden={hidden},bf16)", shape, layers, hidden


def make_model(args) -> dict[str, Any]:
    """Write it (or find it complete) and say what the whole depth would take at this rate."""
    import mlx.core as mx

    from devtools.random_checkpoints import write_random_qwen3

    path, _, shape, layers, hidden = model_spec(args)
    if shape is None:
        return {"path": str(path), "written": False, "note": "a folder: nothing to write"}
    reused = (path / ".complete").exists()
    t0 = now()
    write_random_qwen3(path, layers, hidden, shape=shape)
    seconds = now() - t0
    nbytes = sum(f.stat().st_size for f in path.glob("model*.safetensors"))
    out = {"path": str(path), "shape": shape, "layers": layers, "hidden": hidden,
           "reused": reused, "seconds": round(seconds, 1), "GB": round(nbytes / 1e9, 2),
           "device": str(mx.default_device())}  # fmt: skip
    if not reused and hidden == SHAPES[shape]["hidden"]:
        rate = nbytes / seconds  # bytes per second, embedding and head included
        out["GB_s"] = round(rate / 1e9, 3)
        out["estimate_full_depth_s"] = {}
        for other, s in SHAPES.items():  # the same rate: a bound, not a measurement
            full = 2 * (s["layers"] * layer_params(s) + 2 * VOCAB * s["hidden"])
            out["estimate_full_depth_s"][f"{other} ({s['layers']} layers)"] = round(full / rate)
    return out


def check_shardable(path: Path, tp: int) -> None:
    """Heads and KV heads must divide by tp (mlx-lm's shard splits them evenly)."""
    cfg = json.loads((path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    if heads % tp or kv % tp:
        raise SystemExit(f"{path}: {heads} heads and {kv} KV heads do not divide by --tp {tp} "
                         "(a random smoke shape needs --hidden-override >= 1024)")  # fmt: skip


# ---- phases mlxlm and profile --------------------------------------------------------------
def mlxlm(args, path: Path) -> dict[str, Any]:
    from benchmarks.dev.tp_launch import run_task

    params = {"model": str(path), "what": args.what, "prompt": args.prompt, "tokens": args.tokens,
              "repeats": args.repeats, "concurrency": args.batch, "prefill": args.prefill,
              "backend": args.backend}  # fmt: skip
    runs = {}
    for tp in (1, args.tp):  # in turn: each process has the GPUs to itself
        label = "one" if tp == 1 else f"tp{tp}"
        t0 = now()
        runs[label] = run_task("bench", {**params, "tp": tp}, tp, args.backend, args.timeout)
        runs[label]["wall_s"] = round(now() - t0, 1)
        print(f"mlxlm {label}: {json.dumps(runs[label])}", file=sys.stderr, flush=True)
    one, tp = runs["one"], runs[f"tp{args.tp}"]
    side = {what: {"one_tok_s": one[what]["tok_s"], "tp_tok_s": tp[what]["tok_s"],
                   "tp_over_one": ratio(tp[what]["tok_s"], one[what]["tok_s"])}
            for what in args.what}  # fmt: skip
    return {"backend": args.backend, "tp": args.tp, "runs": runs, "side_by_side": side}


def profile(args, path: Path) -> dict[str, Any]:
    from benchmarks.dev.tp_launch import run_task

    params = {"model": str(path), "context": args.context, "steps": args.steps,
              "collective_repeats": args.collective_repeats, "backend": args.backend}  # fmt: skip
    one = run_task("profile", {**params, "tp": 1}, 1, args.backend, args.timeout)
    tp = run_task("profile", {**params, "tp": args.tp}, args.tp, args.backend, args.timeout)
    w, real, alone = one["with_all_sum"], tp["with_all_sum"], tp["without_all_sum"]
    split = {
        "one_gpu_step_ms": w["step_ms"],
        "tp_step_ms": real["step_ms"],
        "tp_host_build_ms": real["build_ms"],
        "tp_compute_alone_ms": alone["step_ms"],  # no collective at all
        "tp_collectives_in_step_ms": round(real["step_ms"] - alone["step_ms"], 3),
        "all_sums_alone_chain_ms": tp["all_sum_alone"]["ms_per_step_in_chain"],
        "compute_speedup_one_over_tp_alone": ratio(w["step_ms"], alone["step_ms"]),
        "step_speedup_one_over_tp": ratio(w["step_ms"], real["step_ms"]),
        "head_and_argmax_ms_one": round(w["step_ms"] - w["layers_only_ms"], 3),
    }
    return {"backend": args.backend, "tp": args.tp, "one": one, "tpN": tp, "split": split,
            "how": "synchronous steps (build the lazy graph, eval and wait) at --context; "
                   "TP compute alone = the same shards with ShardedToAllLinear's all_sum "
                   "replaced by the identity; collectives in step = TP step - that; "
                   "all_sums alone = one chain of as many all_sums as a forward issues; "
                   "rank 0's timings; head and argmax = step - the layers alone (eval of "
                   "model.model, no lm_head)"}  # fmt: skip


# ---- phase servers -------------------------------------------------------------------------
def servers(args, path: Path) -> dict[str, Any]:
    from benchmarks.dev.serve_openai import run_all, targets
    from benchmarks.dev.tp_gpu_servers import make_servers

    srv = make_servers(path, args)
    skipped: dict[str, str] = {}
    out: dict[str, Any] = {"backend": args.backend, "tp": args.tp, "levels": {},
                           "ours_mode": args.ours_mode,
                           "servers": {n: s.info for n, s in srv.items()}}  # fmt: skip
    loop = argparse.Namespace(**vars(args), one_at_a_time=True, requests=0)
    try:
        run_all(srv, skipped, loop, out)
    finally:
        for s in srv.values():
            s.stop()
            if s.proc is not None:
                log = "".join([*s.past_log, *s.proc.log])
                (args.out / f"tp_gpu-servers-{s.name}.log").write_text(log)
    for n, why in skipped.items():
        out["servers"][n] = {**out["servers"].get(n, {}), "skipped": why}
    out["ours_over_mlx_lm"] = targets(out["levels"])
    return out


# ---- report --------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    plt = bench_io.pyplot()
    panels = [k for k in ("mlxlm", "profile", "servers") if k in result]
    if plt is None or not panels:
        return
    width = max(7.0, 5.5 * len(panels))  # room for the title
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        if key == "mlxlm":
            side = result[key]["side_by_side"]
            xs = range(len(side))
            ax.bar([x - 0.2 for x in xs], [1.0] * len(side), 0.4, label="one process (GPU 0)")
            ax.bar([x + 0.2 for x in xs], [v["tp_over_one"] or 0 for v in side.values()], 0.4,
                   label=f"mlx-lm TP = {result[key]['tp']}")  # fmt: skip
            labels = [f"{k}\n{v['one_tok_s']} / {v['tp_tok_s']} tok/s" for k, v in side.items()]
            ax.set_xticks(list(xs), labels, fontsize=7)
            ax.set_ylabel("tok/s relative to one GPU")
        elif key == "profile":
            s = result[key]["split"]
            names = ["one GPU", "TP, no all_sum", "TP"]
            ax.bar(names, [s["one_gpu_step_ms"], s["tp_compute_alone_ms"], s["tp_step_ms"]],
                   label="step (build + eval)")  # fmt: skip
            ax.bar(["TP"], [s["tp_collectives_in_step_ms"]], label="of which collectives")
            ax.set_ylabel("ms per decode step (synchronous)")
        else:
            levels = result[key]["levels"]
            cs = sorted(levels, key=int)
            for i, name in enumerate(("ours", "mlx-lm")):
                ys = [levels[c].get("median", {}).get(name, {}).get("tok_s") or 0 for c in cs]
                ax.bar([j + 0.4 * i - 0.2 for j in range(len(cs))], ys, 0.4, label=name)
            ax.set_xticks(range(len(cs)), [f"C = {c}" for c in cs])
            ax.set_ylabel("aggregate tok/s over HTTP")
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=7)
    bench_io.suptitled(fig, result, path, 120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("phases", nargs="+", choices=PHASES)
    ap.add_argument("--model", default="random-qwen3-8b", help="a folder or " + ", ".join(RANDOM))
    ap.add_argument("--layers-override", type=int, help="random: layers (8B 36, 32B 64)")
    ap.add_argument("--hidden-override", type=int, help="random: a smaller hidden (smoke tests)")
    ap.add_argument("--ckpt-dir", type=Path, help="random: where the checkpoint goes")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", choices=("nccl", "ring"), help="default: nccl on CUDA, else ring")
    ap.add_argument("--timeout", type=float, default=540.0, help="s for each process run")
    g = ap.add_argument_group("mlxlm")
    g.add_argument("--what", nargs="+", default=["decode", "batch", "prefill"],
                   choices=("decode", "batch", "prefill"))  # fmt: skip
    g.add_argument("--tokens", type=int, default=64, help="decode tokens per stream")
    g.add_argument("--prompt", type=int, default=128, help="single-stream prompt tokens")
    g.add_argument("--batch", type=int, default=32, help="streams of the aggregate decode")
    g.add_argument("--prefill", type=int, default=4096, help="prefill prompt tokens")
    g.add_argument("--repeats", type=int, default=2, help="measured runs after a warm-up")
    g = ap.add_argument_group("profile")
    g.add_argument("--context", type=int, default=512, help="KV tokens before the steps")
    g.add_argument("--steps", type=int, default=16, help="measured decode steps")
    g.add_argument("--collective-repeats", type=int, default=50)
    g = ap.add_argument_group("servers")
    g.add_argument("--servers", default="ours,mlx-lm", help="comma-separated: ours, mlx-lm")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    bench_io.add_loop_flags(g, max_tokens=64, duration=10.0, warmup=3.0, rounds=1)
    g.add_argument("--client-processes", type=int, default=4)
    g.add_argument(
        "--ours",
        default="pipeline2",
        choices=("pipeline2", "tp2", "tp2c", "one"),
        help="preset templates (tp_gpu_servers.py); --ours-cmd replaces them",
    )
    g.add_argument("--ours-cmd", action="append", help="a command template (repeat, in order)")
    g.add_argument(
        "--ours-ready",
        default="listening on",
        help="regex each ours command but the last prints when ready",
    )
    g.add_argument("--ours-ranges", type=int, default=2, help="{range0}.. : even layer ranges")
    g.add_argument(
        "--ours-mode",
        default="default",
        choices=("default", "ar", "wedlm"),
        help="the `mode` body field of our requests (default: none sent)",
    )
    g.add_argument("--start-timeout", type=float, default=600.0, help="s for a server to serve")
    ap.add_argument("--rank-task", help=argparse.SUPPRESS)
    ap.add_argument("--rank-params", help=argparse.SUPPRESS)
    if argv is None:
        argv = sys.argv[1:]
    if "--rank-task" in argv:  # a rank: no phase
        argv = ["mlxlm", *argv]
    args = ap.parse_args(argv)
    for flag in ("tp", "tokens", "prompt", "batch", "prefill", "repeats", "steps", "rounds",
                 "collective_repeats", "ours_ranges"):  # fmt: skip
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.tp < 2:
        ap.error("--tp must be at least 2 (one GPU is always measured)")
    if args.duration <= 0 or args.warmup < 0 or args.timeout <= 0 or args.context < 1:
        ap.error("--duration, --timeout and --context must be positive, --warmup >= 0")
    if min(args.concurrency) < 1:
        ap.error("--concurrency levels must be at least 1")
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := set(args.servers) - {"ours", "mlx-lm"}:
        ap.error(f"unknown servers {sorted(unknown)}; choose from ours, mlx-lm")
    if args.model not in RANDOM and not args.rank_task and not Path(args.model).is_dir():
        ap.error(f"--model {args.model}: not a folder nor one of {', '.join(RANDOM)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rank_task:
        from benchmarks.dev.tp_gpu_ranks import rank_main

        rank_main(args.rank_task, json.loads(args.rank_params))
        return
    if args.backend is None:
        from benchmarks.dev.tp_launch import default_backend

        args.backend = default_backend()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups on a kill
    path, name, _, _, _ = model_spec(args)
    stem = "tp_gpu-" + "-".join(args.phases)
    result: dict[str, Any] = bench_io.run_info(model=name, model_path=str(path),
                                               phases=args.phases, targets=TARGETS)  # fmt: skip
    order = [p for p in PHASES if p in args.phases]  # the model first
    if "make-model" not in order and args.model in RANDOM and not (path / ".complete").exists():
        order.insert(0, "make-model")
    for phase in order:
        if phase != "make-model":
            check_shardable(path, args.tp)
        t0 = now()
        if phase == "make-model":
            result[phase] = make_model(args)
        elif phase == "mlxlm":
            result[phase] = mlxlm(args, path)
        elif phase == "profile":
            result[phase] = profile(args, path)
        else:
            result[phase] = servers(args, path)
        result[phase]["phase_s"] = round(now() - t0, 1)
        print(f"{phase}: {now() - t0:.1f} s", file=sys.stderr, flush=True)
        bench_io.save_json(result, args.out, f"{stem}.partial.json")
    bench_io.finish(result, args.out, stem, {f"{stem}.png": plot})


if __name__ == "__main__":
    main()
