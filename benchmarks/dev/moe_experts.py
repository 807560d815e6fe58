"""Where a DiffusionGemma MoE layer's time goes as the tokens of a step grow (canvases
batched), and whether grouping the token-expert pairs by expert (each expert's rows as
one matrix, M > 1) reads each expert's weights once where the per-pair gather does not.
One layer of DiffusionGemma-26B-A4B's shape, random 4-bit experts. Prints JSON.

  python benchmarks/dev/moe_experts.py --tokens 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx
import mlx.nn as nn


def timed(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 3)


def by_expert(experts, x: mx.array, idx: mx.array, capacity: int) -> mx.array:
    """The experts' outputs [N, k, H] with pairs grouped by expert into [E, C, H] (C =
    capacity >= the busiest expert's pairs), one gather_qmm per projection with M = C."""
    n, k = idx.shape
    e = experts.gate_up_proj.num_experts if hasattr(experts.gate_up_proj, "num_experts") else 128
    flat = idx.reshape(-1)
    order = mx.argsort(flat)
    sorted_e = flat[order]
    counts = (flat[:, None] == mx.arange(e)[None, :]).sum(axis=0)
    starts = mx.cumsum(counts) - counts
    rank = mx.arange(n * k) - starts[sorted_e]
    slot = sorted_e * capacity + rank  # each pair's row in [E * C]
    rows = mx.zeros((e * capacity, x.shape[-1]), x.dtype)
    rows = rows.at[slot].add(x[order // k])
    grouped = rows.reshape(e, capacity, -1)
    ids = mx.arange(e, dtype=mx.uint32)
    gu = experts.gate_up_proj
    h = mx.gather_qmm(
        grouped, gu.weight, gu.scales, gu.biases, rhs_indices=ids, transpose=True,
        group_size=gu.group_size, bits=gu.bits,
    )  # fmt: skip
    d = experts.hidden_dims
    h = nn.gelu_approx(h[..., :d]) * h[..., d:]
    dp = experts.down_proj
    y = mx.gather_qmm(
        h, dp.weight, dp.scales, dp.biases, rhs_indices=ids, transpose=True,
        group_size=dp.group_size, bits=dp.bits,
    )  # fmt: skip
    y = y.reshape(e * capacity, -1)[slot]  # back to pair order (sorted)
    out = mx.zeros((n * k, y.shape[-1]), y.dtype).at[order].add(y)
    return out.reshape(n, k, -1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    from mlx_vlm.models.diffusion_gemma import ModelConfig
    from mlx_vlm.models.diffusion_gemma.language import DecoderLayer

    from benchmarks.dev.diffusion import SHAPE

    text = ModelConfig.from_dict({"text_config": dict(SHAPE)}).text_config
    layer = DecoderLayer(text, 0)
    nn.quantize(layer, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    experts, router = layer.experts, layer.router
    out = {"device": str(mx.default_device())}
    for n in args.tokens:
        x = (mx.random.normal((n, text.hidden_size)) * 0.1).astype(mx.bfloat16)
        idx, _ = router(x)
        mx.eval(idx)
        busiest = int(mx.max((idx.reshape(-1)[:, None] == mx.arange(128)).sum(0)).item())
        cap = -(-busiest // 8) * 8
        row = {
            "pairs": n * text.top_k_experts,
            "busiest_expert": busiest,
            "sorted_gather_ms": timed(lambda x=x, idx=idx: experts(x, idx), args.repeats),
            "by_expert_ms": timed(
                lambda x=x, idx=idx, c=cap: by_expert(experts, x, idx, c), args.repeats
            ),
            "dense_mlp_ms": timed(lambda x=x: layer.mlp(x), args.repeats),
            "router_ms": timed(lambda x=x: router(x), args.repeats),
        }
        a, b = experts(x, idx), by_expert(experts, x, idx, cap)
        row["max_abs_diff"] = float(mx.max(mx.abs(a.astype(mx.float32) - b)).item())
        print(n, row, file=sys.stderr, flush=True)
        out[str(n)] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
