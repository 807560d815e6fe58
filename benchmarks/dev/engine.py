"""Engine benchmark: window forward time vs T at context 512, and single-stream decode
(engine AR, engine WeDLM, mlx-lm's own generate_step), on one model. Prints one JSON
object and writes engine.json + engine.png to --out.

  python benchmarks/dev/engine.py --model default --repeats 3 --tokens 16
  python benchmarks/dev/engine.py --model random-qwen3-8b [--layers 2 --hidden 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: benchmarks/

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map_with_path

from benchmarks.dev.bench_io import add_random_shape_flags, finish, suptitled
from common.generation_params import GenerationParams
from common.kv_rows import KVRows
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.model_parts import ModelParts, load_model_parts, run_layers
from common.window_mask import window_visibility
from coordinator.engine.engine import Engine
from coordinator.engine.local_engine import resolve_model
from coordinator.engine.modes import plan_next
from coordinator.engine.pipeline import LocalPipeline
from coordinator.engine.sequence import Phase
from coordinator.engine.tick_batch import build_batch

T_VALUES = (1, 2, 4, 8, 16, 17, 20, 24, 32, 48, 64)
CONTEXT = 512
WINDOW = 16
now = time.perf_counter


def random_qwen3(layers: int, hidden: int) -> tuple[ModelParts, nn.Module]:
    """Qwen3-8B-shaped model with random weights (bf16 on GPU, fp32 on CPU), no files."""
    from mlx_lm.models import qwen3

    heads = hidden // 128
    # fmt: off
    raw = dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
               intermediate_size=3 * hidden, num_attention_heads=heads,
               num_key_value_heads=max(1, heads // 4), head_dim=128, rms_norm_eps=1e-6,
               vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
               tie_word_embeddings=False)
    # fmt: on
    full = qwen3.Model(qwen3.ModelArgs(**raw))  # lazy parameters, never materialized
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16

    def init(path: str, p: mx.array) -> mx.array:
        if path.endswith("norm.weight"):
            return mx.ones(p.shape, dtype)
        return (mx.random.normal(p.shape) * 0.02).astype(dtype)

    for m in [*full.model.layers, full.model.embed_tokens, full.model.norm, full.lm_head]:
        m.update(tree_map_with_path(init, m.parameters()))
        mx.eval(m.parameters())  # one module at a time bounds peak memory
    # fmt: off
    config = ModelConfig(path=Path("random-qwen3"), raw=raw, model_type="qwen3",
                         family="qwen3", num_layers=layers, hidden_size=hidden,
                         vocab_size=151936, max_position_embeddings=40960,
                         mask_token_id=151665, eos_token_ids=(151645,),
                         tie_word_embeddings=False, quantization=None)
    # fmt: on
    return ModelParts(config, full, LayerRange.full(layers), with_ends=True), full


def mlx_lm_model(parts: ModelParts) -> nn.Module:
    """An mlx-lm model sharing the parts' modules, so both sides run identical weights."""
    arch = importlib.import_module(f"mlx_lm.models.{parts.config.family}")
    full = arch.Model(arch.ModelArgs.from_dict(parts.config.mlx_args()))
    ends = parts.ends.model  # mlx-lm's own model holding the ends' weights (layers relayed)
    full.model.layers = parts.layers
    full.model.embed_tokens, full.model.norm = ends.model.embed_tokens, ends.model.norm
    if not parts.config.tie_word_embeddings:
        full.lm_head = ends.lm_head
    return full


def window_forward(
    parts: ModelParts,
    kv: KVRows,
    tokens: np.ndarray,
    windows: np.ndarray,
    head_slots: np.ndarray | None = None,
):
    """embed → layers through KVRows (no commit) → head on the last row, or on the rows
    `head_slots` names (the logits a decode step needs)."""
    hidden = run_layers(parts, parts.embed(mx.array(tokens)), kv, windows)
    if head_slots is None:
        return parts.head(hidden[:, -1:, :])
    return parts.head(hidden[:, mx.array(head_slots), :])


def projections_forward(parts: ModelParts, hidden: mx.array) -> list[mx.array]:
    """Only the layers' weight matmuls (q/k/v/o, gate/up/down) on `hidden`: no attention,
    no norms, no KV. Its time versus T is the floor MLX's matmuls set for a window forward."""
    h, outs = hidden, []
    for layer in parts.layers:
        a, m = layer.self_attn, layer.mlp
        q = a.q_proj(h)
        outs += [q, a.k_proj(h), a.v_proj(h)]
        h = h + a.o_proj(q)
        h = h + m.down_proj(m.gate_proj(h) * m.up_proj(h))
    return [h, *outs]


def has_dense_projections(parts: ModelParts) -> bool:
    return all(
        hasattr(layer, "self_attn") and hasattr(getattr(layer, "mlp", None), "gate_proj")
        for layer in parts.layers
    )


def wedlm_filled(t: int) -> np.ndarray:
    """A WeDLM-shaped window: the committing run of t-16 filled slots, then a mask first
    and every third slot filled (non-causal visibility, the explicit mask path)."""
    p = max(t - WINDOW, 0)
    filled = np.zeros(t, dtype=bool)
    filled[:p] = True
    filled[p + 1 :: 3] = True
    return filled


@contextmanager
def swapped(layers: list[nn.Module], names: tuple[str, ...], values: list[dict]) -> Iterator:
    """Each layer's modules `names` replaced by values[i][name] while the block lasts."""
    saved = [{n: layer[n] for n in names} for layer in layers]
    for layer, new in zip(layers, values, strict=True):
        layer.update_modules(new)
    try:
        yield
    finally:
        for layer, old in zip(layers, saved, strict=True):
            layer.update_modules(old)


def bench_forward(
    parts: ModelParts, repeats: int, causal: bool, interleave: bool
) -> dict[str, dict[int, list[float]]]:
    """Seconds per forward, every repeat, per window kind and T (plus the head alone)."""
    kv = KVRows(len(parts.layers), 1)
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(0, parts.config.vocab_size, (1, n)).astype(np.int32)  # noqa: E731
    mx.eval(
        run_layers(
            parts, parts.embed(mx.array(ids(CONTEXT))), kv, np.tri(CONTEXT, dtype=bool)[None]
        )
    )
    kv.commit([CONTEXT])
    kinds = {"wedlm": lambda t: window_visibility(wedlm_filled(t))[None]}
    if causal:
        kinds["causal"] = lambda t: np.tri(t, dtype=bool)[None]
    times: dict[str, dict[int, list[float]]] = {k: {t: [] for t in T_VALUES} for k in kinds}

    def once(t: int, kind: str) -> float:
        tokens, windows = ids(t), kinds[kind](t)
        start = now()
        mx.eval(window_forward(parts, kv, tokens, windows))
        return now() - start

    if interleave:  # rounds over every (T, kind); round 0 is the warm-up
        for r in range(repeats + 1):
            for t in T_VALUES:
                for kind in kinds:
                    dt = once(t, kind)
                    if r:
                        times[kind][t].append(dt)
    else:  # blocked: the same shape back to back, two warm-ups first
        for t in T_VALUES:
            for kind in kinds:
                times[kind][t] = [once(t, kind) for _ in range(repeats + 2)][2:]
    assert int(kv.lengths[0]) == CONTEXT
    if has_dense_projections(parts):
        dtype = parts.norm.weight.dtype
        times["projections"] = {}
        for t in (1, 17, 24):
            x = mx.random.normal((1, t, parts.config.hidden_size)).astype(dtype)
            mx.eval(x)
            laps = []
            for _ in range(repeats + 2):
                start = now()
                mx.eval(projections_forward(parts, x))
                laps.append(now() - start)
            times["projections"][t] = laps[2:]
    # The head alone on 1 vs WINDOW rows: a WeDLM step needs logits for W slots.
    hidden = mx.random.normal((1, WINDOW, parts.config.hidden_size)).astype(parts.norm.weight.dtype)
    for rows in (1, WINDOW):
        times.setdefault("head", {})[rows] = []
        for r in range(repeats + 1):
            start = now()
            mx.eval(parts.head(hidden[:, :rows]))
            if r:
                times["head"][rows].append(now() - start)
    return times


def engine_decode(engine: Engine, prompt: list[int], mode: str, n: int, bare: bool) -> dict:
    """One greedy request; stop ids disabled. With `bare`, before each decode step the
    same window (same T, same context) is also run as a bare window forward."""
    params = GenerationParams(mode=mode, window=WINDOW, max_tokens=n, temperature=0.0)
    seq = engine.submit(prompt, params)
    seq.params = dataclasses.replace(seq.params, extra_stop_ids=(), stop_ids=())
    parts = engine.parts
    # run: inside engine._complete; graph: inside pipeline.submit, wherever it is called
    # from (a regular launch, or the look-ahead inside _complete: graph_in_run)
    prof = {"run": 0.0, "graph": 0.0, "graph_in_run": 0.0, "in_run": False}
    run, fwd = engine._complete, engine.pipeline.submit
    if bare:  # a bare forward between steps cannot overlap a forward launched ahead
        engine._launch_ahead = lambda *args: False

    def timed(key, fn):
        def wrapper(*a):
            start = now()
            if key == "run":
                prof["in_run"] = True
            try:
                return fn(*a)
            finally:
                spent = now() - start
                prof[key] += spent
                if key == "run":
                    prof["in_run"] = False
                elif prof["in_run"]:
                    prof["graph_in_run"] += spent

        return wrapper

    engine._complete, engine.pipeline.submit = timed("run", run), timed("graph", fwd)
    steps, bares, with_logits, widths = [], [], [], []
    split: dict[str, list[float]] = {"host": [], "graph": [], "rest": []}
    t_first = None
    try:
        while not seq.finished:
            decoding, before = seq.phase is Phase.DECODE, seq.forwards
            plan = plan_next(seq, engine._plan_context(1))
            batch = build_batch([plan])  # the window the step runs (padded to a width step)
            if bare and decoding:
                win = batch.spec.windows()
                start = now()
                kv = engine.pipeline.runner.store.rows_for([seq.seq_id])  # this seq's KV
                mx.eval(window_forward(parts, kv, batch.tokens, win))
                bare_t = now() - start
                # the same forward with the head on every row the step takes logits of
                start = now()
                mx.eval(window_forward(parts, kv, batch.tokens, win, plan.head_slots))
                logits_t = now() - start
            prof.update(run=0.0, graph=0.0, graph_in_run=0.0)
            start = now()
            engine.step()
            dt = now() - start
            if decoding and seq.forwards > before:  # a tick that ran a forward
                steps.append(dt)
                widths.append(batch.spec.width)
                outside = prof["graph"] - prof["graph_in_run"]
                split["host"].append(dt - prof["run"] - outside)
                split["graph"].append(prof["graph"])
                split["rest"].append(prof["run"] - prof["graph_in_run"])
                if bare:
                    bares.append(bare_t)
                    with_logits.append(logits_t)
            if t_first is None and seq.output:
                t_first = now()
    finally:
        del engine._complete, engine.pipeline.submit
        engine.__dict__.pop("_launch_ahead", None)
    wall = now() - t_first  # includes the bare forwards when `bare`: not a decode rate then
    out = {
        "tokens": len(seq.output),
        "forwards": seq.forwards,
        "step_s": statistics.median(steps),
        "forwards_per_s": len(steps) / sum(steps),
        "tokens_per_forward": len(seq.output) / seq.forwards,
        "median_T": statistics.median(widths),
        **{f"step_{k}_s": statistics.median(v) for k, v in split.items()},
    }
    if not bare:
        out["tps_after_first"] = (len(seq.output) - 1) / wall
    else:
        out["bare_forward_s"] = statistics.median(bares)
        out["step_overhead"] = statistics.median(s / b for s, b in zip(steps, bares, strict=True))
        # selection, sampling, commit and sync only: the forward pays for the step's logits
        out["forward_with_logits_s"] = statistics.median(with_logits)
        out["step_overhead_vs_logits"] = statistics.median(
            s / b for s, b in zip(steps, with_logits, strict=True)
        )
    return out


def mlxlm_decode(model: nn.Module, prompt: list[int], n: int) -> dict:
    """mlx-lm's own greedy loop (what stream_generate drives, minus detokenizing/EOS)."""
    from mlx_lm.generate import generate_step

    t_first, count = None, 0
    for _token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        count += 1
        if t_first is None:
            t_first = now()
    wall = now() - t_first
    return {"tokens": count, "wall_after_first_s": wall, "tps_after_first": (count - 1) / wall}


def bench_decode(parts: ModelParts, mlm: nn.Module, repeats: int, n: int) -> dict:
    engine = Engine(parts, LocalPipeline(parts), 1)
    prompt = [int(t) for t in np.random.default_rng(1).integers(100, 5000, 32)]
    runs = {
        "engine_ar": lambda: engine_decode(engine, prompt, "ar", n, bare=False),
        "mlxlm": lambda: mlxlm_decode(mlm, prompt, n),
        "engine_wedlm": lambda: engine_decode(engine, prompt, "wedlm", n, bare=True),
        "engine_ar_bare": lambda: engine_decode(engine, prompt, "ar", n, bare=True),
    }
    res: dict[str, list[dict]] = {k: [] for k in runs}
    for r in range(repeats + 1):  # ABC ABC ...; round 0 warms up
        for k, fn in runs.items():
            out = fn()
            if r:
                res[k].append(out)
    med = {k: {f: statistics.median(o[f] for o in v) for f in v[0]} for k, v in res.items()}
    med["engine_ar_runs_tps"] = [o["tps_after_first"] for o in res["engine_ar"]]
    med["mlxlm_runs_tps"] = [o["tps_after_first"] for o in res["mlxlm"]]
    return med


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = result["forward_ms"]["wedlm"]["1"]
    for kind, d in result["forward_ms"].items():
        if kind == "head":
            continue
        label = "projections only" if kind == "projections" else f"{kind} window"
        a.plot([int(t) for t in d], list(d.values()), "o-", label=label)
    a.axhline(base, color="gray", ls=":", label="T=1 (AR)")
    a.axhline(1.25 * base, color="red", ls="--", label="1.25 × T=1")
    a.set_xscale("log", base=2)
    a.set(
        xlabel="window rows T", ylabel="forward ms (median)", title=f"forward at context {CONTEXT}"
    )
    a.legend()
    d = result["decode"]
    w = d["engine_wedlm"]
    bars = {
        "engine AR": d["engine_ar"]["tps_after_first"],
        "mlx-lm": d["mlxlm"]["tps_after_first"],
        "engine WeDLM\n(fwd/s × tok/fwd)": w["forwards_per_s"] * w["tokens_per_forward"],
    }
    b.bar(list(bars), list(bars.values()), color=["C0", "C1", "C2"])
    b.set(ylabel="tokens/s", title="single-stream decode (greedy)")
    suptitled(fig, result, path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_shape_flags(ap)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-causal", action="store_true", help="skip the causal-window series")
    ap.add_argument("--interleave", action="store_true", help="(a): round-robin over shapes")
    args = ap.parse_args()
    if args.model == "random-qwen3-8b":
        parts, mlm = random_qwen3(args.layers, args.hidden)
    else:
        parts = load_model_parts(resolve_model(args.model))
        mlm = mlx_lm_model(parts)
    import mlx_lm

    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # not every backend reports it
        name = ""
    result = {
        "model": args.model
        if args.model != "random-qwen3-8b"
        else f"random-qwen3-8b(layers={args.layers},hidden={args.hidden})",
        "device": f"{mx.default_device()} {name}".strip(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "context": CONTEXT,
        "forward_order": "interleaved" if args.interleave else "blocked",
        "repeats": args.repeats,
        "tokens": args.tokens,
        "date": time.strftime("%Y-%m-%d"),
    }
    raw = bench_forward(parts, args.repeats, not args.no_causal, args.interleave)
    fwd = {k: {t: statistics.median(v) for t, v in d.items()} for k, d in raw.items()}
    result["forward_ms"] = {k: {str(t): v * 1e3 for t, v in d.items()} for k, d in fwd.items()}
    result["forward_min_ms"] = {
        k: {str(t): min(v) * 1e3 for t, v in d.items()} for k, d in raw.items()
    }
    w, lo = fwd["wedlm"], {t: min(v) for t, v in raw["wedlm"].items()}
    result["ratio_16p"] = {str(t): w[t] / w[1] for t in (17, 20, 24)}
    result["ratio_16p_min"] = {str(t): lo[t] / lo[1] for t in (17, 20, 24)}  # jitter-robust
    if "projections" in fwd:  # what the matmuls alone give for the same T
        proj = fwd["projections"]
        result["ratio_projections"] = {str(t): proj[t] / proj[1] for t in (17, 24)}
    dec = bench_decode(parts, mlm, args.repeats, args.tokens)
    result["decode"] = dec
    result["ratios"] = {
        "engine_ar_over_mlxlm": dec["engine_ar"]["tps_after_first"]
        / dec["mlxlm"]["tps_after_first"],
        "wedlm_step_overhead": dec["engine_wedlm"]["step_overhead"],
        "wedlm_step_overhead_excl_head": (
            dec["engine_wedlm"]["step_s"] - fwd["head"][WINDOW] + fwd["head"][1]
        )
        / dec["engine_wedlm"]["bare_forward_s"],
        "wedlm_step_overhead_vs_logits": dec["engine_wedlm"]["step_overhead_vs_logits"],
        "ar_step_overhead": dec["engine_ar_bare"]["step_overhead"],
        "ratio_16p_T17": result["ratio_16p"]["17"],
        "median_step_width": dec["engine_wedlm"]["median_T"],
    }
    result["targets"] = {
        "engine_ar_over_mlxlm": ">= 0.95",
        "wedlm_step_overhead": "<= 1.10",
        "ratio_16p": "<= 1.25",
    }
    finish(result, args.out, "engine", {"engine.png": plot})


if __name__ == "__main__":
    main()
