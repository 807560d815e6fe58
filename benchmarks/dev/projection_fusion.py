"""q/k/v and gate/up fused into one matmul each (common/fused_projections.py) against the
layers' own projections, one forward at a time, in one process. Prints one JSON object and
writes projection_fusion.json and projection_fusion.png to --out.

The same weights are loaded twice (fused, and with fuse=False); the engine's layers swap
their attention and MLP modules between the two, alternating every block of forwards so
that the machine's drift (on a shared GPU machine, a process's AR step moves by 50 % between
minutes) falls on both alike; the widths alternate the same way. Per width T, at a
committed context of --context rows:
- serial: build the forward's graph, then evaluate it and wait (ms per forward);
- chained: --chain forwards launched back to back (`mx.async_eval`), then one wait: the
  host's cost per forward when the device keeps up, as in the engine's look-ahead.
T = 1 is an AR step's forward (no mask); T > 1 a WeDLM window (explicit non-causal mask).

  python benchmarks/dev/projection_fusion.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from benchmarks.dev.bench_io import finish, pyplot, run_info
from benchmarks.dev.engine import prefilled_rows, random_window_forward, swapped
from common.model_parts import ModelParts, load_model_parts

now = time.perf_counter


@contextmanager
def unfused_layers(parts: ModelParts, unfused: list[nn.Module] | None):
    """`parts`' layers run with `unfused`'s attention and MLP modules (the same weights,
    loaded with fuse=False) while the block lasts; None leaves them as they are."""
    if unfused is None:
        yield
        return
    names = ("self_attn", "mlp")
    with swapped(parts.layers, names, [{n: ref[n] for n in names} for ref in unfused]):
        yield


def _serial(forward) -> tuple[float, float]:
    t0 = now()
    out = forward()
    t1 = now()
    mx.eval(out)
    return t1 - t0, now() - t0


def _chained(forward, n: int) -> float:
    t0 = now()
    outs = []
    for _ in range(n):
        outs.append(forward())
        mx.async_eval(outs[-1])
    mx.eval(outs)
    return (now() - t0) / n


def measure(parts, unfused, widths: list[int], context: int, repeats: int, chain: int) -> dict:
    rng = np.random.default_rng(0)
    kv = prefilled_rows(parts, context, rng)
    variants = {"fused": None, "unfused": unfused}
    samples = {
        (v, t, k): [] for v in variants for t in widths for k in ("build", "serial", "chained")
    }
    forwards = {t: random_window_forward(parts, kv, t, rng) for t in widths}
    for i in range(repeats + 2):  # the first 2 rounds warm up
        # every width and variant in every round, in alternating order: drift falls on all
        for t in widths if i % 2 == 0 else widths[::-1]:
            for v in list(variants) if i % 2 == 0 else list(variants)[::-1]:
                with unfused_layers(parts, variants[v]):
                    build, serial = _serial(forwards[t])
                    chained = _chained(forwards[t], chain)
                if i >= 2:
                    samples[(v, t, "build")].append(build)
                    samples[(v, t, "serial")].append(serial)
                    samples[(v, t, "chained")].append(chained)
    out: dict = {}
    for (v, t, k), xs in samples.items():
        out.setdefault(v, {}).setdefault(f"T{t}", {})[f"{k}_ms"] = round(
            1e3 * statistics.median(xs), 3
        )
    for t in widths:  # paired per round: fused / unfused
        for k in ("serial", "chained"):
            pairs = zip(samples[("fused", t, k)], samples[("unfused", t, k)], strict=True)
            ratio = statistics.median(f / u for f, u in pairs)
            out.setdefault("fused_vs_unfused", {})[f"T{t}/{k}"] = round(ratio, 3)
    for v in variants:  # a wide forward against a one-row one, paired per round
        for t in widths[1:]:
            for k in ("serial", "chained"):
                pairs = zip(samples[(v, t, k)], samples[(v, 1, k)], strict=True)
                out[v][f"T{t}"][f"{k}_vs_T1"] = round(statistics.median(w / o for w, o in pairs), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/wedlm-smollm2-135m-r2"))
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=40, help="rounds of each variant per width")
    ap.add_argument("--chain", type=int, default=8, help="forwards launched back to back")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if args.widths[0] != 1:
        ap.error("--widths starts with 1 (the one-row forward the others are compared with)")
    parts = load_model_parts(args.model)
    unfused = list(load_model_parts(args.model, fuse=False).layers)
    result = run_info(model=args.model, widths=args.widths, context=args.context,
                      repeats=args.repeats, chain=args.chain)  # fmt: skip
    result |= measure(parts, unfused, args.widths, args.context, args.repeats, args.chain)
    finish(result, args.out, "projection_fusion", {"projection_fusion.png": plot})


def plot(result: dict, path: Path) -> None:
    """ms per forward by width, fused against unfused, serial and chained."""
    plt = pyplot()
    widths = result["widths"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for v, style in (("fused", "-"), ("unfused", "--")):
        for k, marker in (("serial", "o"), ("chained", "s")):
            ys = [result[v][f"T{t}"][f"{k}_ms"] for t in widths]
            ax.plot(widths, ys, style, marker=marker, label=f"{v}, {k}")
    ax.set_xlabel("rows in the forward (T)")
    ax.set_ylabel("ms per forward (median)")
    ax.set_title(f"{Path(result['model']).name} on {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
