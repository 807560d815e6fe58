"""Where a tensor group's forward goes (issue 32): our group processes driven directly,
without the engine or HTTP, against the same layers run in one process.

Method. `--tp` GroupMembers (common/tensor_group/member.py) are started from this process,
rank r's group process on GPU r (`--gpus`; `CUDA_VISIBLE_DEVICES` per rank, as `mlx.launch
--backend nccl` sets) or all on the CPU with `ring`. For each batch size B in `--rows`, B
sequences are prefilled with `--context` tokens of random hidden states, then `--steps`
decode forwards of one row per sequence run, one at a time, as the engine's coordinator-led
group does (`GroupStage`: launch, then wait for the answer). For each forward:
- `round_trip`: this process's launch to the decoded answer;
- from the leader's group process: `share` (the message handed to every rank: one all_sum,
  which also waits for the slowest rank to be ready), `build` (the layers' lazy graph),
  `eval` (the device: split layers and their all_sums, plus the confirming all_sum),
  `readback` (the output to host bytes);
- `pipe` = round trip − (share + build + eval + readback): the two pipe transfers, msgpack,
  and this process's encode/decode;
- `head`: after each forward this process runs an lm_head of `--head` rows and a greedy
  pick on its own GPU (GPU 0, shared with rank 0's group process), as the coordinator does.
And one prefill forward of `--prefill` rows (median of 3 after one unmeasured).
Then the whole layer range in this process (`one`, on GPU 0 with the group stopped): the
same forwards built and evaluated. Medians. One JSON line; --out gets a JSON file.

  GPU (nvidia-h200-x2):  python benchmarks/dev/tp_group_trace.py --model random-qwen3-8b \\
                             --ckpt-dir /tmp/ck8 --gpus 2 --out $OUT
  CPU dry run:           python benchmarks/dev/tp_group_trace.py --model random-qwen3-8b \\
                             --layers-override 2 --hidden-override 1024 --rows 1 4 --steps 8 \\
                             --context 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the project root holds benchmarks/
    sys.path.insert(0, str(ROOT))

import mlx.core as mx
import numpy as np

from benchmarks.dev import bench_io
from benchmarks.dev.bench_io import now
from benchmarks.dev.tp_gpu import RANDOM, make_model, model_spec
from common.free_port import free_port
from common.kv_format import FULL
from common.layer_range import LayerRange
from common.layer_runner import LayerRunner
from common.model_config import load_model_config
from common.model_parts import load_model_parts
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, wire_form
from common.tensor_group.member import GroupMember
from common.tensor_group.spec import GroupSpec
from common.wire_frames import WireTensor

SPLIT = ("share_s", "build_s", "eval_s", "readback_s")


def _spec(seq_ids: list[int], start: int, width: int) -> RowsSpec:
    b = len(seq_ids)
    return RowsSpec(
        list(seq_ids),
        np.full(b, start, np.int64),
        np.full(b, width, np.int64),
        np.ones((b, width), bool),
        np.full(b, width, np.int64),
    )


def _workload(rows: int, context: int, steps: int, first_id: int):
    """(prefill specs, decode specs) of `rows` sequences: one prefill each, then steps."""
    ids = list(range(first_id, first_id + rows))
    prefill = [_spec([i], 0, context) for i in ids]
    decode_steps = [_spec(ids, context + k, 1) for k in range(steps)]
    return ids, prefill, decode_steps


def _hidden(spec: RowsSpec, hidden: int, rng: np.random.Generator) -> mx.array:
    x = rng.standard_normal((spec.num_rows, spec.width, hidden), dtype=np.float32)
    return mx.array(x * 0.1).astype(mx.bfloat16)


def _start_group(path: Path, layers: LayerRange, tp: int, gpus: int) -> list[GroupMember]:
    backend = "nccl" if gpus >= tp else "ring"
    hosts = [f"127.0.0.1:{free_port()}" for _ in range(tp)]
    members: list[GroupMember | None] = [None] * tp
    errors: list[BaseException] = []

    def start(rank: int) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank % gpus)} if gpus else None
        try:
            spec = GroupSpec(rank, tp, hosts, backend)
            members[rank] = GroupMember(path, layers, FULL, spec, env=env)
        except BaseException as e:  # reported after every thread has ended
            errors.append(e)

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for m in members:
            if m is not None:
                m.stop()
        raise errors[0]
    return members  # type: ignore[return-value]


def _group_forward(
    leader: GroupMember, spec: RowsSpec, x: mx.array, slots: np.ndarray | None = None
) -> mx.array:
    wire, raw = wire_form(x)
    host = np.array(raw)
    leader.launch(spec, WireTensor(wire, host.shape, host.tobytes()), slots)
    out, _ = leader.finish()
    y = decode(out)
    mx.eval(y)
    return y


def _head(hidden: int, vocab: int):
    """The coordinator's part of a step on this process's GPU: the lm_head over the
    last hidden states and the greedy pick (None: --head 0)."""
    if not vocab:
        return None
    w = (mx.random.normal((vocab, hidden)) * 0.02).astype(mx.bfloat16)
    mx.eval(w)

    def run(y: mx.array) -> None:
        mx.eval(mx.argmax(y[:, -1, :] @ w.T, axis=-1))

    return run


def _prefill_ms(forward, spec_of_rows, hidden: int, rng, repeats: int) -> float | None:
    """Median ms of one forward of a fresh sequence's whole prompt (kept as KV; only its
    last row's output is read back, as the engine asks for a prompt)."""
    if not spec_of_rows:
        return None
    times = []
    for r in range(repeats + 1):
        spec = _spec([900_000 + r], 0, spec_of_rows)
        x = _hidden(spec, hidden, rng)
        mx.eval(x)
        t0 = now()
        forward(spec, x, [900_000 + r])
        if r:  # the first builds the shape's kernels
            times.append(now() - t0)
    return _median_ms(times)


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3) if values else float("nan")


def trace_group(path: Path, config, args) -> dict[str, Any]:
    layers = LayerRange(0, config.num_layers - 1)
    members = _start_group(path, layers, args.tp, args.gpus)
    leader = members[0]
    rng = np.random.default_rng(0)
    head = _head(config.hidden_size, args.head)
    out: dict[str, Any] = {"backend": leader.spec.backend, "ready": leader.ready}

    def prompt(spec, x, ids) -> None:
        _group_forward(leader, spec, x, np.array([[spec.width - 1]]))
        prompt_split.update(leader.last_split)
        leader.release(ids)

    prompt_split: dict[str, float] = {}

    try:
        for b in args.rows:
            ids, prefill, steps = _workload(b, args.context, args.warmup + args.steps, 1000 * b)
            for spec in prefill:
                _group_forward(leader, spec, _hidden(spec, config.hidden_size, rng))
            rt: list[float] = []
            heads: list[float] = []
            split: dict[str, list[float]] = {k: [] for k in SPLIT}
            for k, spec in enumerate(steps):
                x = _hidden(spec, config.hidden_size, rng)
                mx.eval(x)
                t0 = now()
                y = _group_forward(leader, spec, x)
                t1 = now()
                if head is not None:
                    head(y)
                if k >= args.warmup:
                    rt.append(t1 - t0)
                    heads.append(now() - t1)
                    for key in SPLIT:
                        split[key].append(leader.last_split.get(key, 0.0))
            leader.release(ids)
            inside = [sum(v) for v in zip(*(split[k] for k in SPLIT), strict=True)]
            pipe = [r - i for r, i in zip(rt, inside, strict=True)]
            out[f"B={b}"] = {
                "round_trip_ms": _median_ms(rt),
                **{k.removesuffix("_s") + "_ms": _median_ms(v) for k, v in split.items()},
                "pipe_ms": _median_ms(pipe),
                "head_ms": _median_ms(heads),
            }
            print(f"  group B={b}: {out[f'B={b}']}", file=sys.stderr)
        out["prefill_ms"] = _prefill_ms(prompt, args.prefill, config.hidden_size, rng, 3)
        out["prefill_split_ms"] = {
            k.removesuffix("_s") + "_ms": round(v * 1e3, 2) for k, v in prompt_split.items()
        }
        print(f"  group prefill {args.prefill}: {out['prefill_ms']} ms {out['prefill_split_ms']}",
              file=sys.stderr)  # fmt: skip
    finally:
        for m in members:
            m.stop()
    return out


def trace_one(path: Path, config, args) -> dict[str, Any]:
    if args.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # (read at MLX's first GPU use)
    parts = load_model_parts(
        path, LayerRange(0, config.num_layers - 1), with_ends=False, config=config
    )
    runner = LayerRunner(parts, FULL)
    rng = np.random.default_rng(0)
    head = _head(config.hidden_size, args.head)
    out: dict[str, Any] = {}

    def prompt(spec, x, ids) -> None:
        mx.eval(runner.forward(spec, x, validate=False, reply_slots=np.array([[spec.width - 1]])))
        runner.release(ids)

    for b in args.rows:
        ids, prefill, steps = _workload(b, args.context, args.warmup + args.steps, 1000 * b)
        for spec in prefill:
            mx.eval(runner.forward(spec, _hidden(spec, config.hidden_size, rng), validate=False))
        build, wait, heads = [], [], []
        for k, spec in enumerate(steps):
            x = _hidden(spec, config.hidden_size, rng)
            mx.eval(x)
            t0 = now()
            y = runner.forward(spec, x, validate=False)
            t1 = now()
            mx.eval(y)
            t2 = now()
            if head is not None:
                head(y)
            if k >= args.warmup:
                build.append(t1 - t0)
                wait.append(t2 - t1)
                heads.append(now() - t2)
        runner.release(ids)
        total = [a + w for a, w in zip(build, wait, strict=True)]
        out[f"B={b}"] = {"step_ms": _median_ms(total), "build_ms": _median_ms(build),
                         "eval_ms": _median_ms(wait), "head_ms": _median_ms(heads)}  # fmt: skip
        print(f"  one B={b}: {out[f'B={b}']}", file=sys.stderr)
    out["prefill_ms"] = _prefill_ms(prompt, args.prefill, config.hidden_size, rng, 3)
    print(f"  one prefill {args.prefill}: {out['prefill_ms']} ms", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint folder or " + " / ".join(RANDOM))
    ap.add_argument("--ckpt-dir", type=Path, default=None)
    ap.add_argument("--layers-override", type=int, default=0)
    ap.add_argument("--hidden-override", type=int, default=0)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=0, help="GPUs, one per rank (0: CPU, ring)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=4096, help="prompt rows timed (0: none)")
    ap.add_argument("--head", type=int, default=151936,
                    help="vocabulary of an lm_head run here after each forward, as the "
                    "coordinator does on its GPU (0: none)")  # fmt: skip
    ap.add_argument("--phases", nargs="+", default=["group", "one"], choices=["group", "one"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    path, name, *_ = model_spec(args)
    if args.model in RANDOM and not (path / ".complete").exists():
        make_model(args)
    config = load_model_config(path)
    run = bench_io.run_info(
        model=name, tp=args.tp, gpus=args.gpus, context=args.context, steps=args.steps
    )
    result: dict[str, Any] = {"run": run}
    if "group" in args.phases:
        result["group"] = trace_group(path, config, args)
    if "one" in args.phases:
        result["one"] = trace_one(path, config, args)
    if "group" in result and "one" in result:
        result["group_vs_one"] = {
            key: round(result["group"][key]["round_trip_ms"] / result["one"][key]["step_ms"], 3)
            for key in result["one"]
            if key.startswith("B=")
        }
        if result["one"].get("prefill_ms"):
            result["prefill_one_vs_group"] = round(
                result["one"]["prefill_ms"] / result["group"]["prefill_ms"], 3
            )
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tp_group_trace.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
