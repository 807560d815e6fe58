"""What a WeDLM step costs beyond its layers, eager against `mx.compile` (issue 35).

Besides the forward, a WeDLM step runs graphs an AR step does not: selection over the
window's slots (entropy of each slot's logits, the position penalty, threshold, argmin
fallback: selection.py), the next window's visibility built on the device
(window_mask.device_visibility, for the look-ahead) and that forward's attention mask over
the cache (window_mask.attention_mask). step_ops.py counts them at about 95 MLX primitives
per step; on MLX-CUDA each costs the host its recording and launch. This times them at a
step's shapes, each iteration built and evaluated (medians), eagerly and compiled, the two
alternated in one process.

  python benchmarks/dev/step_extras.py --rows 1 4 --repeats 200
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
from common.window_mask import attention_mask, device_visibility
from coordinator.engine.selection import entropy, select_fills


def extras(logits, is_mask, threshold, penalty, filled, starts, span):
    """The step's graphs besides the layers: selection, then the next forward's masks."""
    fills = select_fills(entropy(logits.astype(mx.float32)), is_mask, threshold, penalty)
    windows = device_visibility(filled)
    return fills, attention_mask(starts, windows, span)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--span", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()

    compiled = mx.compile(extras)
    result = run_info(rows=args.rows, window=args.window, vocab=args.vocab, span=args.span)
    out: dict = {}
    for b in args.rows:
        w = args.window
        inputs = (
            mx.random.normal((b, w, args.vocab)).astype(mx.float16),
            mx.ones((b, w), mx.bool_),
            mx.full((b,), 0.6),
            mx.full((b,), 0.02),
            mx.arange(2 * w)[None, :].astype(mx.int32) % 3 == 0,
            mx.full((b,), 100, mx.int32),
            args.span,
        )
        mx.eval(inputs[:-1])
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        same = all(
            mx.array_equal(x, y).item()
            for x, y in zip(extras(*inputs), compiled(*inputs), strict=True)
        )
        for i in range(args.repeats + 10):
            for name, fn in (("eager", extras), ("compiled", compiled)):
                t0 = time.perf_counter()
                mx.eval(fn(*inputs))
                if i >= 10:
                    times[name].append(time.perf_counter() - t0)
        out[f"B{b}"] = {k: round(1e3 * statistics.median(v), 4) for k, v in times.items()} | {
            "same_outputs": same
        }
    result["ms_per_step"] = out
    finish(result, args.out, "step_extras", {})


if __name__ == "__main__":
    main()
