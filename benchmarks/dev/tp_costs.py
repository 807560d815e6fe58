"""Tensor parallelism's groundwork (issue 31): what an all-reduce costs on mlx.distributed's
`ring` backend, whether mlx-lm's own `Model.shard` decodes the same tokens as one process,
what one rank's half-width forward costs against the whole width, and a projection for
2 and 4 Macs built from those and from stated assumptions. Prints one JSON object and writes
tp_costs.json + tp_costs.png to --out.

  python benchmarks/dev/tp_costs.py                                 # every phase, defaults
  python benchmarks/dev/tp_costs.py --phases collectives --repeats 50
  python benchmarks/dev/tp_costs.py --phases half_width --layers 2  # on a GPU: the real shapes
  python benchmarks/dev/tp_costs.py --phases handoff --repeats 200  # ring send/recv vs gRPC

Phases `collectives` and `shard` start 2 real processes of this script joined by `ring` over
127.0.0.1 (the hostfile is the one `mlx.launch --backend ring` writes: one list of
"ip:port" per rank; MLX_RANK and MLX_HOSTFILE in the environment). Phase `handoff`
(benchmarks/dev/tp_handoff.py) moves a hidden state between two processes over ring's
send/recv and over our gRPC relay hop.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: benchmarks/

from benchmarks.dev import tp_handoff
from benchmarks.dev.bench_io import finish, median_ms, now, pyplot, run_info
from benchmarks.dev.tp_shapes import (
    DTYPES,
    SHAPES,
    block_args,
    project,
    small_qwen3_args,
)

PHASES = ("collectives", "shard", "half_width", "project", "handoff")
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- launching a ring group


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_ring(task: str, params: dict[str, Any], size: int = 2, timeout: float = 300) -> dict:
    """Run `task` in `size` processes joined by `ring` on loopback; rank 0's JSON line."""
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(size)]))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-task", task,
               "--rank-params", json.dumps(params)]  # fmt: skip
        procs = [
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
            )
            for r in range(size)
        ]
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        finally:  # a peer that died leaves the other blocked in a collective
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"ring rank {r} of {task} failed ({p.returncode}): {err[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _rank_main(task: str, params: dict[str, Any]) -> None:
    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    tasks = {"collectives": rank_collectives, "shard": _rank_shard,
             "handoff": tp_handoff.rank_handoff}  # fmt: skip
    result = tasks[task](group, params)
    if group.rank() == 0:
        print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- phase: collectives


def rank_collectives(group, p: dict[str, Any]) -> dict[str, Any]:
    """Median ms of one all_sum per message (an eval each), and per all_sum when `chain`
    of them run in one graph (the way a forward issues them: 2 per layer)."""
    import mlx.core as mx

    repeats = p["repeats"]
    messages: list[tuple[str, tuple[int, ...], Any]] = []
    for hidden in p["hiddens"]:
        for dt in p["dtypes"]:
            messages.append((f"hidden {hidden} {dt}", (1, 1, hidden), DTYPES[dt]))
    for kib in p["kib"]:
        messages.append((f"{kib} KiB float32", (kib * 256,), mx.float32))

    def barrier() -> None:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))

    out = []
    for name, shape, dtype in messages:
        x = mx.ones(shape, dtype)
        mx.eval(x)
        barrier()
        one = median_ms(lambda x=x: mx.eval(mx.distributed.all_sum(x, group=group)),
                        repeats, warmup=5)  # fmt: skip

        def chained(x=x) -> None:
            y = x
            for _ in range(p["chain"]):  # the scale keeps values finite; it is one tiny op
                y = mx.distributed.all_sum(y, group=group) * 0.5
            mx.eval(y)

        barrier()
        chain = median_ms(chained, max(3, repeats // 10), warmup=1) / p["chain"]
        nbytes = int(x.nbytes)
        out.append({"message": name, "bytes": nbytes, "ms_one": round(one, 4),
                    "ms_in_chain": round(chain, 4),
                    "MB_s_one": round(nbytes / one / 1e3, 1)})  # fmt: skip
    return {"group_size": group.size(), "rows": out}


def collectives_phase(args: argparse.Namespace) -> dict[str, Any]:
    params = {"repeats": args.repeats, "hiddens": args.hiddens, "dtypes": args.dtypes,
              "kib": args.kib, "chain": args.chain}  # fmt: skip
    res = run_ring("collectives", params)
    # A decode step's per-token cost: 2 all-reduces per layer (after attention, after the MLP).
    per_token = []
    for row in res["rows"]:
        if not row["message"].startswith("hidden"):
            continue
        hidden = int(row["message"].split()[1])
        for name, shape in SHAPES.items():
            if shape["hidden"] != hidden:
                continue
            n = 2 * shape["layers"]
            # fmt: off
            per_token.append({"shape": name, "message": row["message"], "all_reduces": n,
                              "ms_per_token_one": round(n * row["ms_one"], 3),
                              "ms_per_token_in_chain": round(n * row["ms_in_chain"], 3)})
            # fmt: on
    return {**res, "per_token_tp2": per_token, "measured": "ring over 127.0.0.1, this host"}


# ---------------------------------------------------------------- phase: shard


def _small_model(p: dict[str, Any]):
    """The same random small qwen3 in every process (seeded), float32."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import qwen3

    mx.random.seed(p["seed"])
    model = qwen3.Model(qwen3.ModelArgs(**small_qwen3_args(p["layers"], p["hidden"])))
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.05, model.parameters()))
    mx.eval(model.parameters())
    return model


def _greedy(model, p: dict[str, Any]) -> dict[str, Any]:
    """Greedy decode of p['tokens'] tokens after a seeded prompt: tokens, ms/token, logits."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, p["vocab"], (p["prompt"],), key=mx.random.key(p["seed"] + 1))
    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)[:, -1]
    tok = mx.argmax(logits, axis=-1)
    mx.eval(tok)
    first_logits = np.array(logits[0]).tolist()
    tokens = [int(tok.item())]
    t0 = now()
    for _ in range(p["tokens"] - 1):
        logits = model(tok[None], cache=cache)[:, -1]
        tok = mx.argmax(logits, axis=-1)
        tokens.append(int(tok.item()))
    ms = (now() - t0) * 1e3 / max(1, p["tokens"] - 1)
    return {"tokens": tokens, "ms_per_token": round(ms, 3), "first_logits": first_logits}


def _rank_shard(group, p: dict[str, Any]) -> dict[str, Any]:
    model = _small_model(p)
    model.shard(group)  # mlx-lm's own: heads and MLP columns split, o/down all-reduced
    return _greedy(model, p)


def shard_phase(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    p = {"seed": 0, "layers": args.shard_layers, "hidden": args.shard_hidden,
         "vocab": small_qwen3_args(1, 64)["vocab_size"], "prompt": 16,
         "tokens": args.tokens}  # fmt: skip
    whole = _greedy(_small_model(p), p)  # alone first: the two ranks then share the CPU
    tp2 = run_ring("shard", p)
    a, b = np.array(whole.pop("first_logits")), np.array(tp2.pop("first_logits"))
    diff = float(np.abs(a - b).max())
    return {"model": {**p, "dtype": "float32"}, "whole": whole, "tp2": tp2,
            "identical_tokens": whole["tokens"] == tp2["tokens"],
            "first_logits_max_abs_diff": diff,
            "note": "both TP ranks run on this host's cores: the TP time includes their "
                    "contention, and the whole model's time is one process alone"}  # fmt: skip


# ---------------------------------------------------------------- phase: handoff


def handoff_phase(args: argparse.Namespace) -> dict[str, Any]:
    p = {"repeats": args.repeats, "warmup": 10, "messages": args.handoff_messages}
    ring = run_ring("handoff", p)  # the ranks start before the gRPC pair: no overlap
    return tp_handoff.compare(ring, tp_handoff.grpc_handoff(p))


# ---------------------------------------------------------------- phase: half_width


def half_width_phase(args: argparse.Namespace) -> dict[str, Any]:
    """ms per T=1 forward of --layers layers, whole width against one TP rank's half (heads,
    KV heads and MLP columns halved; the all-reduce itself is not in it)."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3 import ModelArgs, TransformerBlock

    dtype = DTYPES[args.half_dtype]
    rows = []
    for name in args.shapes:
        for tp in (1, 2):
            margs = ModelArgs(**block_args(SHAPES[name], tp))
            blocks = [TransformerBlock(margs) for _ in range(args.layers)]
            for b in blocks:  # one block at a time bounds peak memory
                b.update(tree_map(lambda w: (mx.random.normal(w.shape) * 0.02).astype(dtype),
                                  b.parameters()))  # fmt: skip
                mx.eval(b.parameters())
            caches = []
            for _ in blocks:  # a decode step at --context: the KV already there
                c = KVCache()
                kv = (1, margs.num_key_value_heads, args.context, margs.head_dim)
                c.update_and_fetch(mx.zeros(kv, dtype), mx.zeros(kv, dtype))
                mx.eval(c.keys, c.values)
                caches.append(c)
            x = mx.random.normal((1, 1, margs.hidden_size)).astype(dtype)

            def forward(blocks=blocks, caches=caches, x=x) -> None:
                h = x
                for b, c in zip(blocks, caches, strict=True):
                    h = b(h, mask=None, cache=c)
                mx.eval(h)
                for c in caches:  # stay at --context
                    c.offset -= 1

            ms = median_ms(forward, args.repeats_half, warmup=2)
            weights = sum(w.nbytes for b in blocks for _, w in _flat(b.parameters()))
            rows.append({"shape": name, "tp": tp, "layers": args.layers, "ms": round(ms, 3),
                         "ms_per_layer": round(ms / args.layers, 4),
                         "weight_GB": round(weights / 1e9, 3),
                         "GB_s": round(weights / ms / 1e6, 1)})  # fmt: skip
            del blocks, caches
    speedup = {}
    for name in args.shapes:
        t = {r["tp"]: r["ms"] for r in rows if r["shape"] == name}
        speedup[name] = round(t[1] / t[2], 3)
    return {"dtype": args.half_dtype, "context": args.context, "rows": rows,
            "whole_over_half": speedup}  # fmt: skip


def _flat(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


# ---------------------------------------------------------------- the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--repeats", type=int, default=200, help="collectives: timed all_sums")
    ap.add_argument("--hiddens", type=int, nargs="+", default=[4096, 5120])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=DTYPES)
    ap.add_argument("--kib", type=int, nargs="+", default=[256, 4096], help="message sizes")
    ap.add_argument("--chain", type=int, default=72, help="all_sums in one graph (8B: 2 x 36)")
    ap.add_argument("--shard-layers", type=int, default=4)
    ap.add_argument("--shard-hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16, help="shard: greedy tokens")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--layers", type=int, default=2, help="half_width: layers per forward")
    ap.add_argument("--context", type=int, default=512, help="half_width: KV rows present")
    ap.add_argument("--half-dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--repeats-half", type=int, default=10)
    ap.add_argument("--bandwidth-gbs", type=float, default=819.0, help="projection: per Mac")
    ap.add_argument("--hop-ms", type=float, default=0.4,
                    help="projection: one pipeline hop of a decode token (assumed)")  # fmt: skip
    ap.add_argument("--handoff-messages", nargs="+", default=list(tp_handoff.MESSAGES),
                    choices=tp_handoff.MESSAGES, metavar="MESSAGE",
                    help="handoff: which hidden states (default: all)")  # fmt: skip
    ap.add_argument("--rank-task", help=argparse.SUPPRESS)
    ap.add_argument("--rank-params", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag in ("repeats", "chain", "shard_layers", "tokens", "layers", "repeats_half"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.context < 0 or args.bandwidth_gbs <= 0 or args.hop_ms < 0:
        ap.error("--context and --hop-ms must be >= 0, --bandwidth-gbs > 0")
    if args.shard_hidden % 128 or args.shard_hidden < 128:
        ap.error("--shard-hidden must be a multiple of 128 (heads of 64, 2 KV heads per rank)")
    return args


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None or "project" not in result:
        return
    rows = result["project"]["rows"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r['shape']} {r['weights']}\n{r['macs']} Macs, {r['link']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["pipeline_ms"] for r in rows], 0.4, label="pipeline")
    ax.bar([x + 0.2 for x in xs], [r["tp_ms"] for r in rows], 0.4, label="tensor parallel")
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
    ax.set_ylabel("projected ms / token (one stream)")
    ax.legend()
    fig.suptitle(f"TP vs pipeline, projected (M3 Ultra {result['project']['bandwidth_GB_s']} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rank_task:
        _rank_main(args.rank_task, json.loads(args.rank_params))
        return
    result: dict[str, Any] = run_info(model="random qwen3 shapes", phases=args.phases)
    for phase in args.phases:
        t0 = now()
        if phase == "collectives":
            result[phase] = collectives_phase(args)
        elif phase == "shard":
            result[phase] = shard_phase(args)
        elif phase == "half_width":
            result[phase] = half_width_phase(args)
        elif phase == "handoff":
            result[phase] = handoff_phase(args)
        else:
            result[phase] = project(args.bandwidth_gbs, args.hop_ms, result.get("collectives"))
        print(f"{phase}: {now() - t0:.1f} s", file=sys.stderr)
    finish(result, args.out, "tp_costs", {"tp_costs.png": plot, "tp_handoff.png": tp_handoff.plot})


if __name__ == "__main__":
    main()
