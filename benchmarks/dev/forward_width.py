"""What a forward's width costs, and which kernel the cost comes from (issue 35).

A speculative or WeDLM forward is one forward of several rows, where AR's is one row. On
MLX-CUDA the quantized matmul picks its kernel by rows: fewer than 8 rows (M x batch) run
the matrix-vector kernel (qmv), 8 or more a matrix-matrix one, which for 6-bit weights is
the generic one (mlx/backend/cuda/quantized/quantized.cpp). Three parts, on the model's
own weights:

  qmm        one quantized matmul of each of the model's weight shapes, M rows, in a chain
             of 30 calls per eval (the host's cost per call shared out): microseconds per
             call, for the model's bits and 8-bit (the same weights requantized).
  bare       one forward of T rows at a 512-token context, the explicit (non-causal) window
             mask and a causal one: serial (build + eval) and build alone, ms.
  pipelined  the engine's look-ahead: forward t+1 is built and launched before forward t is
             read back, each fed from the previous one's output on the device; ms per
             forward in the steady state.

  python benchmarks/dev/forward_width.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx
import numpy as np

from benchmarks.dev.bench_io import build_then_wait, finish, run_info
from benchmarks.dev.engine import CONTEXT, wedlm_filled, window_forward
from common.kv_rows import KVRows
from common.model_parts import ModelParts, load_model_parts, run_layers
from common.window_mask import window_visibility

WIDTHS = [1, 2, 4, 6, 7, 8, 9, 12, 16, 24, 32]
CHAIN = 30


def qmm_us(parts: ModelParts, widths: list[int], repeats: int) -> dict:
    """Microseconds per quantized matmul call, by weight shape, bits and rows."""
    layer = parts.layers[0]
    linears = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj,
               "gate_proj": layer.mlp.gate_proj, "down_proj": layer.mlp.down_proj}  # fmt: skip
    out: dict = {}
    for name, lin in linears.items():
        if not hasattr(lin, "scales"):
            return {"skipped": "the model is not quantized"}
        w = mx.dequantize(lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits)
        n, k = w.shape
        for bits in sorted({lin.bits, 8}):
            qw, s, b = mx.quantize(w, lin.group_size, bits)
            mx.eval(qw, s, b)
            for m in widths:
                x = mx.random.normal((1, m, k)).astype(w.dtype)
                mx.eval(x)

                def chain(x=x, qw=qw, s=s, b=b, bits=bits, group=lin.group_size) -> mx.array:
                    ys = [mx.quantized_matmul(x, qw, s, b, True, group, bits)
                          for _ in range(CHAIN)]  # fmt: skip
                    return mx.stack(ys)

                build, wait = build_then_wait(chain, repeats)
                total = statistics.median(b_ + w_ for b_, w_ in zip(build, wait, strict=True))
                out[f"{name} {n}x{k}/{bits}-bit/M{m}"] = round(1e6 * total / CHAIN, 1)
    return out


def bare(parts: ModelParts, kv: KVRows, widths: list[int], repeats: int) -> dict:
    rng = np.random.default_rng(0)
    out: dict = {}
    for t in widths:
        masks = {"causal": np.tri(t, dtype=bool)[None]}
        if t > 1:
            masks["explicit"] = window_visibility(wedlm_filled(t))[None]
        for kind, windows in masks.items():
            heads = np.arange(t)[None] if t > 1 else None
            ids = rng.integers(0, parts.config.vocab_size, (1, t)).astype(np.int32)

            def forward(ids=ids, windows=windows, heads=heads) -> mx.array:
                return window_forward(parts, kv, ids, windows, heads)

            build, wait = build_then_wait(forward, repeats)
            out[f"{kind}/T{t}"] = {
                "serial_ms": round(1e3 * statistics.median(b + w for b, w in zip(build, wait,
                                                                                  strict=True)), 3),
                "build_ms": round(1e3 * statistics.median(build), 3),
            }  # fmt: skip
    return out


def pipelined(parts: ModelParts, kv: KVRows, widths: list[int], steps: int) -> dict:
    """ms per forward when each is launched before the previous one is read back."""
    out: dict = {}
    for t in widths:
        windows = window_visibility(wedlm_filled(t))[None] if t > 1 else np.tri(1, dtype=bool)[None]
        heads = np.arange(t)[None] if t > 1 else None

        def step(prev: mx.array, t=t, windows=windows, heads=heads) -> mx.array:
            ids = mx.argmax(prev[:, -1:, :], axis=-1).astype(mx.int32)  # fed on the device
            ids = mx.repeat(ids, t, axis=1)
            hidden = run_layers(parts, parts.embed(ids), kv, windows)
            rows = hidden if heads is None else hidden[:, mx.array(heads[0]), :]
            return parts.head(rows[:, -1:, :] if heads is None else rows)

        prev = parts.head(parts.embed(mx.zeros((1, 1), dtype=mx.int32)))
        mx.eval(prev)
        times = []
        for i in range(steps + 3):
            t0 = time.perf_counter()
            nxt = step(prev)
            mx.async_eval(nxt)
            mx.eval(prev)  # the read-back of the previous forward
            _ = np.array(prev[0, -1, :4])
            prev = nxt
            if i >= 3:
                times.append(time.perf_counter() - t0)
        mx.eval(prev)
        out[f"T{t}"] = round(1e3 * statistics.median(times), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--widths", type=int, nargs="+", default=WIDTHS)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--parts", nargs="+", default=["qmm", "bare", "pipelined"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    parts = load_model_parts(args.model)
    kv = KVRows(len(parts.layers), 1)
    ctx = np.random.default_rng(1).integers(0, parts.config.vocab_size, (1, CONTEXT))
    mx.eval(run_layers(parts, parts.embed(mx.array(ctx.astype(np.int32))), kv,
                       np.tri(CONTEXT, dtype=bool)[None]))  # fmt: skip
    kv.commit([CONTEXT])
    result = run_info(model=str(args.model), widths=args.widths, context=CONTEXT)
    if "qmm" in args.parts:
        result["qmm_us"] = qmm_us(parts, args.widths, args.repeats)
        print(f"qmm: {result['qmm_us']}", file=sys.stderr, flush=True)
    if "bare" in args.parts:
        result["bare"] = bare(parts, kv, args.widths, args.repeats)
        print(f"bare: {result['bare']}", file=sys.stderr, flush=True)
    if "pipelined" in args.parts:
        result["pipelined_ms"] = pipelined(parts, kv, args.widths, 4 * args.repeats)
    finish(result, args.out, "forward_width")


if __name__ == "__main__":
    main()
