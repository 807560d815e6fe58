"""Where a window forward's time goes as its rows T grow: the whole forward, the same
forward with attention taken out, and the layers' weight matmuls alone. One sequence at
context 512, WeDLM-shaped windows (explicit mask) for T > 1. Explains `ratio_16p` of
benchmarks/dev/engine.py: which part of the forward grows with T. Prints one JSON object and
writes window_cost.json + window_cost.png to --out.

  python benchmarks/dev/window_cost.py --model random-qwen3-8b
  python benchmarks/dev/window_cost.py --model random-qwen3-8b --layers 2 --hidden 256
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_io import add_random_shape_flags, finish
from benchmarks.dev.engine import (
    CONTEXT,
    has_dense_projections,
    projections_forward,
    random_qwen3,
    wedlm_filled,
    window_forward,
)
from common.kv_rows import KVRows
from common.model_parts import ModelParts, load_model_parts, run_layers
from common.window_mask import window_visibility
from coordinator.engine.local_engine import resolve_model

T_VALUES = (1, 2, 4, 8, 16, 17, 24, 32)
now = time.perf_counter


@contextmanager
def attention_removed(parts: ModelParts):
    """The model family's attention call returns its queries unchanged (same shape, no
    work): what is left of the forward is everything but attention. Benchmark only."""
    module = importlib.import_module(f"mlx_lm.models.{parts.config.family}")
    original = module.scaled_dot_product_attention
    module.scaled_dot_product_attention = lambda queries, *a, **k: queries
    try:
        yield
    finally:
        module.scaled_dot_product_attention = original


def measure(parts: ModelParts, repeats: int) -> dict[str, dict[int, list[float]]]:
    kv = KVRows(len(parts.layers), 1)
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(0, parts.config.vocab_size, (1, n)).astype(np.int32)  # noqa: E731
    prompt = parts.embed(mx.array(ids(CONTEXT)))
    mx.eval(run_layers(parts, prompt, kv, np.tri(CONTEXT, dtype=bool)[None]))
    kv.commit([CONTEXT])
    family = importlib.import_module(f"mlx_lm.models.{parts.config.family}")
    variants: dict[str, Callable[[int], object]] = {}

    def window(t: int) -> np.ndarray:
        return window_visibility(wedlm_filled(t))[None] if t > 1 else np.ones((1, 1, 1), bool)

    variants["forward"] = lambda t: window_forward(parts, kv, ids(t), window(t))
    if hasattr(family, "scaled_dot_product_attention"):

        def no_attention(t: int):
            with attention_removed(parts):
                return window_forward(parts, kv, ids(t), window(t))

        variants["forward_without_attention"] = no_attention
    if has_dense_projections(parts):
        dtype = parts.norm.weight.dtype
        inputs = {
            t: mx.random.normal((1, t, parts.config.hidden_size)).astype(dtype) for t in T_VALUES
        }
        mx.eval(list(inputs.values()))
        variants["projections_only"] = lambda t: projections_forward(parts, inputs[t])
    times: dict[str, dict[int, list[float]]] = {k: {t: [] for t in T_VALUES} for k in variants}
    for r in range(repeats + 1):  # rounds over every (T, variant); round 0 warms up
        for t in T_VALUES:
            for name, build in variants.items():
                laps = []
                for _ in range(3):  # the first of each group pays for a change of shape
                    start = now()
                    mx.eval(build(t))
                    laps.append(now() - start)
                if r:
                    times[name][t] += laps[1:]
    assert int(kv.lengths[0]) == CONTEXT, "window forwards must not commit"
    return times


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, d in result["ms"].items():
        ax.plot([int(t) for t in d], list(d.values()), "o-", label=name.replace("_", " "))
    base = result["ms"]["forward"]["1"]
    ax.axhline(1.25 * base, color="red", ls="--", label="1.25 × forward at T=1")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="window rows T", ylabel="ms (median)", title=f"context {CONTEXT}")
    ax.legend()
    fig.suptitle(f"{result['model']} on {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_shape_flags(ap, "random-qwen3-8b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = ap.parse_args()
    if args.model == "random-qwen3-8b":
        parts, _ = random_qwen3(args.layers, args.hidden)
        name = f"random-qwen3-8b(layers={args.layers},hidden={args.hidden})"
    else:
        parts, name = load_model_parts(resolve_model(args.model)), args.model
    times = measure(parts, args.repeats)
    ms = {k: {str(t): statistics.median(v) * 1e3 for t, v in d.items()} for k, d in times.items()}
    result = {
        "model": name,
        "device": f"{mx.default_device()} {mx.device_info().get('device_name', '')}".strip(),
        "mlx": mx.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "context": CONTEXT,
        "repeats": args.repeats,
        "ms": ms,
        "over_T1": {k: {t: v / d["1"] for t, v in d.items()} for k, d in ms.items()},
    }
    if "forward_without_attention" in ms:
        full, rest = ms["forward"], ms["forward_without_attention"]
        result["attention_ms"] = {t: full[t] - rest[t] for t in full}
    finish(result, args.out, "window_cost", {"window_cost.png": plot})


if __name__ == "__main__":
    main()
