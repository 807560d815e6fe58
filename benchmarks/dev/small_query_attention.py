"""The small-query attention kernel against MLX's own attention, on CUDA (issue 35).

common/small_query_attention.py sends an attention of 2-32 query rows to one custom kernel
instead of cuDNN's fused attention. Three parts:

  parity     the largest difference from mx.fast.scaled_dot_product_attention, masked
             (WeDLM windows at per-row starts) and causal, fp16 and bf16, KV read from
             wider buffers as the engine's cache returns them.
  per_call   microseconds per call at a 576-key context: 30 independent calls per eval
             (the host's and the device's cost shared out) and a chain of 30 where each
             call takes the previous one's output (latency, as layers run).
  forward    the model's pipelined forward by width (forward_width.pipelined), with
             MLX's attention, with the kernel, and with no attention at all (what the
             rest of the forward costs); modes alternate, --rounds times.

  python benchmarks/dev/small_query_attention.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx
import numpy as np

from benchmarks.dev.bench_io import figure, finish, finish_axes, now, run_info, save_figure
from benchmarks.dev.engine import CONTEXT
from benchmarks.dev.forward_width import pipelined
from common import small_query_attention as sqa
from common.kv_rows import KVRows
from common.model_parts import load_model_parts, run_layers
from common.window_mask import attention_mask, batch_window_masks

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention
# rows, queries per row, keys, key buffer capacity
PARITY_SHAPES = [(1, 2, 64, 256), (1, 16, 128, 256), (8, 8, 192, 256), (4, 32, 512, 768),
                 (3, 5, 64, 64)]  # fmt: skip
CALL_WIDTHS = [1, 2, 8, 16, 32]  # 1: with a mask array, which MLX composes from ops
FORWARD_WIDTHS = [1, 2, 8, 16, 32]
CALLS = 30


def random_attention(rng, b: int, t: int, span: int, capacity: int, dtype, causal: bool):
    """Queries [b, H, t, D], keys and values as [:b, :, :span] slices of wider buffers (as
    the engine's cache returns them), and a WeDLM window mask at random starts or causal."""

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q = normal(b, t, HEADS, DIM).transpose(0, 2, 1, 3)
    k = normal(b + 1, KV_HEADS, capacity, DIM)[:b, :, :span, :]
    v = normal(b + 1, KV_HEADS, capacity, DIM)[:b, :, :span, :]
    if causal:
        return q, k, v, "causal"
    windows = batch_window_masks([rng.random(t) < 0.5 for _ in range(b)], t)
    starts = mx.array(rng.integers(0, span - t + 1, size=b), dtype=mx.int32)
    return q, k, v, attention_mask(starts, mx.array(windows), span)


def parity() -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for dtype in (mx.float16, mx.bfloat16):
        for b, t, span, capacity in PARITY_SHAPES:
            for causal in (False, True):
                q, k, v, mask = random_attention(rng, b, t, span, capacity, dtype, causal)
                ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, mask=mask)
                got = sqa.small_query_attention(q, k, v, DIM**-0.5, mask)
                err = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
                kind = "causal" if causal else "window"
                out[f"{str(dtype).split('.')[-1]}/B{b}/T{t}/S{span}/{kind}"] = err
    return {"max_abs_error": max(out.values()), "by_shape": out}


def _with_threads(threads: int, fn):
    """`fn` run with the kernel's block at `threads` threads per query row."""

    def call(*a):
        kept, sqa.THREADS = sqa.THREADS, threads
        try:
            return fn(*a)
        finally:
            sqa.THREADS = kept

    return call


def per_call(repeats: int, threads: list[int]) -> dict:
    rng = np.random.default_rng(1)
    out: dict = {}
    for t in CALL_WIDTHS:
        q, k, v, mask = random_attention(rng, 1, t, 576, 768, mx.float16, False)
        mx.eval(q, k, v, mask)
        fns = {
            "mlx": lambda x, k=k, v=v, m=mask: mx.fast.scaled_dot_product_attention(
                x, k, v, scale=0.125, mask=m
            ),
            "kernel": lambda x, k=k, v=v, m=mask: sqa.small_query_attention(x, k, v, 0.125, m),
        }
        for n in threads:  # block sizes other than the kernel's own (THREADS)
            if n != sqa.THREADS:
                fns[f"kernel{n}"] = _with_threads(n, fns["kernel"])
                ref = fns["mlx"](q).astype(mx.float32)
                err = mx.abs(fns[f"kernel{n}"](q).astype(mx.float32) - ref).max().item()
                out[f"kernel{n}/T{t}/max_abs_error"] = err
        for name, fn in fns.items():
            mx.eval(fn(q))
            independent, chained = [], []
            for _ in range(repeats):
                t0 = now()
                mx.eval([fn(q) for _ in range(CALLS)])
                independent.append(now() - t0)
                x = q
                t0 = now()
                for _ in range(CALLS):
                    x = fn(x)
                mx.eval(x)
                chained.append(now() - t0)
            out[f"{name}/T{t}"] = {
                "independent_us": round(1e6 * statistics.median(independent) / CALLS, 1),
                "chained_us": round(1e6 * statistics.median(chained) / CALLS, 1),
            }
    return out


def forwards(model: Path, rounds: int, steps: int) -> dict:
    """Pipelined forward ms by width and attention mode, modes alternating each round."""
    import mlx_lm.models.llama as llama

    parts = load_model_parts(model)
    routed = llama.scaled_dot_product_attention  # sqa.install's wrapper
    kv = KVRows(len(parts.layers), 1)
    ctx = np.random.default_rng(1).integers(0, parts.config.vocab_size, (1, CONTEXT))
    mx.eval(run_layers(parts, parts.embed(mx.array(ctx.astype(np.int32))), kv,
                       np.tri(CONTEXT, dtype=bool)[None]))  # fmt: skip
    kv.commit([CONTEXT])
    runs: dict[str, list[dict]] = {"mlx": [], "kernel": [], "none": []}
    try:
        for r in range(rounds):
            for mode in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                if mode == "none":
                    llama.scaled_dot_product_attention = lambda q, *_a, **_k: q
                else:
                    llama.scaled_dot_product_attention = routed
                    os.environ["WEDLM_SMALL_QUERY_ATTENTION"] = "1" if mode == "kernel" else "0"
                runs[mode].append(pipelined(parts, kv, FORWARD_WIDTHS, steps))
                print(f"{mode}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    finally:
        llama.scaled_dot_product_attention = routed
        os.environ.pop("WEDLM_SMALL_QUERY_ATTENTION", None)
    return {
        mode: {w: round(statistics.median(run[w] for run in rs), 3) for w in rs[0]}
        for mode, rs in runs.items()
    }


def plot(result: dict, path: Path) -> None:
    made = figure(1, f"{result['model']} on {result['device']}")
    if made is None or "forward_ms" not in result:
        return
    fig, (ax,) = made
    for mode, by_width in result["forward_ms"].items():
        ax.plot(FORWARD_WIDTHS, [by_width[f"T{w}"] for w in FORWARD_WIDTHS], marker="o", label=mode)
    finish_axes(ax, "rows per forward", "pipelined forward (ms)", FORWARD_WIDTHS)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="a checkpoint for the forward part")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="forward part: rounds over the modes")
    ap.add_argument("--threads", type=int, nargs="*", default=[],
                    help="per-call part: also time the kernel at these block sizes")  # fmt: skip
    ap.add_argument("--skip-forward", action="store_true", help="parity and per-call parts only")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if not sqa.available():
        sys.exit("the kernel runs on MLX's CUDA backend only (this device: "
                 f"{mx.default_device()})")  # fmt: skip
    result = run_info(model=str(args.model) if args.model else None)
    result["parity"] = parity()
    print(f"parity: max {result['parity']['max_abs_error']}", file=sys.stderr, flush=True)
    result["per_call"] = per_call(args.repeats, args.threads)
    print(f"per call: {result['per_call']}", file=sys.stderr, flush=True)
    if args.model and not args.skip_forward:
        result["forward_ms"] = forwards(args.model, args.rounds, 3 * args.repeats)
    finish(result, args.out, "small_query_attention",
           {"small_query_attention.png": plot})  # fmt: skip


if __name__ == "__main__":
    main()
