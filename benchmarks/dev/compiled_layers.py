"""How much of a forward's host cost `mx.compile` would remove (issue 35: on MLX's CUDA
backend a 30-layer 135M forward is bound by the host building and launching its graph).

The checkpoint's layer stack runs on T rows with no KV cache (causal attention within the
rows), eagerly and through `mx.compile`, each timed two ways: serial (call + eval, median
ms) and build only (the call without eval: the host's share). Both forms give the same
hidden states (checked). Prints one JSON object; writes compiled_layers.json to --out.

  python benchmarks/dev/compiled_layers.py --model ../shared/models/wedlm-smollm2-135m-r2
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

from benchmarks.dev.bench_io import finish, run_info
from common.model_parts import load_model_parts

now = time.perf_counter


def stack(layers):
    def forward(hidden: mx.array) -> mx.array:
        mask = "causal" if hidden.shape[1] > 1 else None
        for layer in layers:
            hidden = layer(hidden, mask, cache=None)
        return hidden

    return forward


def timed(fn, x: mx.array, repeats: int) -> dict[str, float]:
    serial, build = [], []
    for r in range(repeats + 3):
        t0 = now()
        out = fn(x)
        t1 = now()
        mx.eval(out)
        t2 = now()
        if r >= 3:  # the first calls trace and compile
            build.append(t1 - t0)
            serial.append(t2 - t0)
    return {
        "serial_ms": round(1e3 * statistics.median(serial), 3),
        "build_ms": round(1e3 * statistics.median(build), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/wedlm-smollm2-135m-r2"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()

    parts = load_model_parts(Path(args.model))
    eager = stack(parts.layers)
    compiled = mx.compile(eager)
    result = run_info(model=args.model, layers=len(parts.layers), rows=args.rows)
    dtype = parts.norm.weight.dtype
    for t in args.rows:
        x = mx.random.normal((1, t, parts.config.hidden_size)).astype(dtype)
        mx.eval(x)
        diff = mx.abs(eager(x).astype(mx.float32) - compiled(x).astype(mx.float32)).max()
        one = {"eager": timed(eager, x, args.repeats), "compiled": timed(compiled, x, args.repeats)}
        one["max_abs_diff"] = float(diff)
        one["serial_compiled_vs_eager"] = round(
            one["compiled"]["serial_ms"] / one["eager"]["serial_ms"], 3
        )
        result[f"T{t}"] = one
        print(f"T={t}: {one}", file=sys.stderr, flush=True)
    finish(result, args.out, "compiled_layers")


if __name__ == "__main__":
    main()
