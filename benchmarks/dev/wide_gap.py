"""Where a wide forward's extra cost is, part by part (issue 35). Prints one JSON object and
writes wide_gap.json and wide_gap.png to --out.

On MLX-CUDA a forward of 16 rows costs ~1.8 ms more than a one-row one, attention kernel
or not (RESULTS SC10's "no attention" row, SC14), and fusing 90 of its 211 matmul calls
away left that gap as it was. Here each part of the forward is switched off in turn, in
one process, and the gap (T rows minus one row) is measured with and without it:

  attention  the attention itself returns its queries (the KV write stays)
  kv_write   the KV cache is read but not written
  rope       the rotary embedding returns its input
  norms      the layers' RMS norms return their input
  head       the last norm only, no logits (the head's matmul over the vocabulary)
  dense      the layers' quantized linears as float ones (weights dequantized, fused alike)
  causal     the window is causal: the kernel's causal variant, no mask array to build
  one_rope   q and k roped in two calls, as mlx-lm's code does, instead of one
             (common/fused_attention.py)

Variants combine with "+": `bare` is attention+kv_write+rope+norms+head (the matmuls and
the residual adds are left), `bare+dense` the same on float weights. Every variant and
width runs in every round, the order alternating, so the machine's drift falls on all; the
gap is paired per round. Per (variant, T), ms per forward:
- serial: build the forward's graph, launch it and wait (`serial_launch`: until the launch
  returned; with MLX_MAX_OPS_PER_BUFFER=100000 the rest is the device's time, since MLX
  then commits the whole forward as one CUDA graph at the end of the launch);
- chained: --chain forwards launched back to back, then one wait; `launch` is the part
  before the wait (the host's, while the device runs behind it).

  python benchmarks/dev/wide_gap.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from benchmarks.dev.bench_io import figure, finish, run_info, save_figure
from benchmarks.dev.engine import prefilled_rows, random_window_forward, swapped
from common import fused_attention
from common.fused_projections import fuse_projections
from common.kv_rows import LayerKV
from common.model_parts import ModelParts, load_model_parts

now = time.perf_counter
PARTS = ("attention", "kv_write", "rope", "norms", "head", "dense", "causal", "one_rope")
DEFAULT_VARIANTS = ["full", "attention", "kv_write", "rope", "norms", "head", "dense", "causal",
                    "bare", "bare+dense"]  # fmt: skip
BARE = ("attention", "kv_write", "rope", "norms", "head")


class Identity(nn.Module):
    """A rope or norm that returns its input (the rope's `offset` is ignored)."""

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return x


def dequantized(layers: list[nn.Module]) -> None:
    """Every QuantizedLinear in `layers` becomes a float Linear of the same weights."""
    for layer in layers:
        for _, module in layer.named_modules():
            for key, child in list(module.items()):
                if not isinstance(child, nn.QuantizedLinear):
                    continue
                w = mx.dequantize(child.weight, child.scales, child.biases, child.group_size,
                                  child.bits)  # fmt: skip
                dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in child)
                dense.weight = w
                if "bias" in child:
                    dense.bias = child.bias
                module[key] = dense
    mx.eval([layer.parameters() for layer in layers])


@contextmanager
def two_rope_calls(attentions: list[nn.Module]) -> Iterator:
    """The attentions that rope q and k in one call run mlx-lm's own two calls meanwhile."""
    adopted = [a for a in attentions if type(a).__call__ is fused_attention._one_rope_call]
    for a in adopted:
        a.__class__ = type(a).__base__
    try:
        yield
    finally:
        for a in adopted:
            a.__class__ = fused_attention._with_one_rope_call(type(a))


def _no_attention(queries, keys, values, cache=None, scale=None, mask=None, sinks=None):
    return queries


def _read_only(self: LayerKV, keys: mx.array, values: mx.array):
    """The cache's current rows, as `update_and_fetch` returns them, without the write."""
    rows, b = self._rows(), keys.shape[0]
    return self.keys[:b, :, : rows.span, :], self.values[:b, :, : rows.span, :]


def switched_off(parts: ModelParts, off: set[str], dense_layers: list[nn.Module] | None):
    """A context in which `parts`' forward runs without the parts named in `off`."""
    stack = ExitStack()
    layers = parts.layers
    if "attention" in off:
        family = sys.modules[type(layers[0].self_attn).__module__]
        stack.enter_context(mock.patch.object(family, "scaled_dot_product_attention",
                                              _no_attention))  # fmt: skip
    if "kv_write" in off:
        stack.enter_context(mock.patch.object(LayerKV, "update_and_fetch", _read_only))
    if "head" in off:
        stack.enter_context(mock.patch.object(ModelParts, "head", lambda self, h: self.norm(h)))
    if "dense" in off:
        stack.enter_context(swapped(layers, ("self_attn", "mlp"), [
            {"self_attn": d["self_attn"], "mlp": d["mlp"]} for d in dense_layers]))  # fmt: skip
    if "rope" in off:  # after dense: the rope of whichever attention module runs
        attns = [layer["self_attn"] for layer in layers]
        stack.enter_context(swapped(attns, ("rope",), [{"rope": Identity()} for _ in attns]))
    if "one_rope" in off:
        stack.enter_context(two_rope_calls([layer["self_attn"] for layer in layers]))
    if "norms" in off:
        names = ("input_layernorm", "post_attention_layernorm")
        stack.enter_context(swapped(layers, names, [dict.fromkeys(names, Identity())
                                                    for _ in layers]))  # fmt: skip
    return stack


def _serial(forward) -> tuple[float, float]:
    """(launch, total) seconds of one forward: built and launched (`mx.async_eval`),
    then waited for. With MLX_MAX_OPS_PER_BUFFER above the forward's op count MLX commits
    it as one CUDA graph when the launch ends, so the wait is the device's time."""
    t0 = now()
    out = forward()
    mx.async_eval(out)
    t1 = now()
    mx.eval(out)
    return t1 - t0, now() - t0


def _chained(forward, n: int) -> tuple[float, float]:
    """(launch, total) seconds per forward of n launched back to back, then one wait."""
    t0 = now()
    outs = []
    for _ in range(n):
        outs.append(forward())
        mx.async_eval(outs[-1])
    t1 = now()
    mx.eval(outs)
    return (t1 - t0) / n, (now() - t0) / n


def measure(parts: ModelParts, dense_layers, variants: list[str], widths: list[int],
            context: int, repeats: int, chain: int) -> dict:  # fmt: skip
    rng = np.random.default_rng(0)
    kv = prefilled_rows(parts, context, rng)
    offs = {v: set() if v == "full" else set(v.replace("bare", "+".join(BARE)).split("+"))
            for v in variants}  # fmt: skip
    kinds = ("serial_launch", "serial", "launch", "chained")
    samples = {(v, t, k): [] for v in variants for t in widths for k in kinds}
    forwards = {(v, t): random_window_forward(parts, kv, t, rng, "causal" in offs[v])
                for v in variants for t in widths}  # fmt: skip
    for i in range(repeats + 2):  # the first 2 rounds warm up
        for v in variants if i % 2 == 0 else variants[::-1]:
            with switched_off(parts, offs[v], dense_layers):
                for t in widths if i % 2 == 0 else widths[::-1]:
                    # unmeasured: the first forward after a switch may build its CUDA
                    # graphs anew (SC15's first run: serial outliers of 4-9 ms)
                    mx.eval(forwards[(v, t)]())
                    serial_launch, serial = _serial(forwards[(v, t)])
                    launch, chained = _chained(forwards[(v, t)], chain)
                    if i >= 2:
                        xs = (serial_launch, serial, launch, chained)
                        for k, x in zip(kinds, xs, strict=True):
                            samples[(v, t, k)].append(x)
    out: dict = {}
    for v in variants:
        row = out.setdefault(v, {})
        for t in widths:
            for k in kinds:
                row[f"T{t}_{k}_ms"] = round(1e3 * statistics.median(samples[(v, t, k)]), 3)
        for t in widths[1:]:  # the gap: T rows minus one row, paired per round
            for k in kinds:
                pairs = zip(samples[(v, t, k)], samples[(v, 1, k)], strict=True)
                row[f"gap_T{t}_{k}_ms"] = round(1e3 * statistics.median(w - o for w, o in pairs),
                                                3)  # fmt: skip
    if "full" in variants:  # how much of the full forward's gap each part accounts for
        for v in variants:
            for t in widths:  # the variant's forward against the full one, paired per round
                for k in ("serial", "chained"):
                    pairs = zip(samples[(v, t, k)], samples[("full", t, k)], strict=True)
                    out[v][f"T{t}_{k}_vs_full"] = round(statistics.median(a / b for a, b in pairs),
                                                        3)  # fmt: skip
            for t in widths[1:]:
                for k in ("serial", "chained"):
                    key = f"gap_T{t}_{k}_ms"
                    out[v][f"explains_T{t}_{k}_ms"] = round(out["full"][key] - out[v][key], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/wedlm-smollm2-135m-r2"))
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                    help=f"'full', or parts switched off joined by '+' ({', '.join(PARTS)}; "
                         "'bare' is attention+kv_write+rope+norms+head)")  # fmt: skip
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30, help="rounds of every variant and width")
    ap.add_argument("--chain", type=int, default=8, help="forwards launched back to back")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if args.widths[0] != 1 or len(args.widths) < 2:
        ap.error("--widths starts with 1 (the one-row forward the others are compared with)")
    for v in args.variants:
        bad = set(v.replace("bare", "+".join(BARE)).split("+")) - set(PARTS) - {"full"}
        if bad:
            ap.error(f"--variants {v}: unknown part(s) {sorted(bad)}; parts: {', '.join(PARTS)}")
    parts = load_model_parts(args.model)
    dense_layers = None
    if any("dense" in v for v in args.variants):
        dense_layers = list(load_model_parts(args.model, fuse=False).layers)
        dequantized(dense_layers)
        fuse_projections(dense_layers)
    result = run_info(model=args.model, variants=args.variants, widths=args.widths,
                      context=args.context, repeats=args.repeats, chain=args.chain,
                      ops_per_buffer=os.environ.get("MLX_MAX_OPS_PER_BUFFER"))  # fmt: skip
    result |= measure(parts, dense_layers, args.variants, args.widths, args.context,
                      args.repeats, args.chain)  # fmt: skip
    finish(result, args.out, "wide_gap", {"wide_gap.png": plot})


def plot(result: dict, path: Path) -> None:
    """The gap (widest T minus one row), serial and chained, per variant."""
    t = result["widths"][-1]
    variants = result["variants"]
    made = figure(1, f"{Path(result['model']).name} on {result['device']}: parts switched off")
    if made is None:
        return
    fig, (ax,) = made
    x = np.arange(len(variants))
    for k, dx in (("serial", -0.2), ("chained", 0.2)):
        ax.bar(x + dx, [result[v][f"gap_T{t}_{k}_ms"] for v in variants], 0.4, label=k)
    ax.set_xticks(x, variants, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"T={t} minus T=1, ms per forward (median of pairs)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
