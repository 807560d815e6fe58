"""Diffusion decoding's benchmarks: (DiffusionGemma) on a random 4-bit checkpoint of
DiffusionGemma-26B-A4B's shape (hidden 2816, 128 experts of 704, top-8, 262,144-token
vocabulary, sliding + full attention; --layers of its 30, said in the output). Prints one
JSON object and writes diffusion.json + diffusion.png to --out.

Phases (--phases):
  split     One denoising step's parts at B canvases (--batch): the layers, then the head
            and the faithful or turbo sampler step; synchronized, medians of --repeats.
  samplers  Single stream, one 256-token answer per request (one canvas), --repeats each,
            faithful and turbo interleaved, in one process: tok/s, denoising steps per
            canvas and milliseconds per step (medians).
  batch     B canvases denoised together (B = --batch, turbo and faithful): aggregate tok/s
            over B requests submitted at once, medians of --repeats; ratios to B = 1.

Random weights decide how confident a step is, hence how many steps a canvas takes: those
counts describe this checkpoint, not DiffusionGemma's text. The per-step costs and the
batching ratios are what carries over. The phases confident, ablation and stages (runs
D4-D6, history only) left with issue 55: `git log -S phase_ablation` finds them.

  python benchmarks/dev/diffusion.py --layers 30 --phases samplers batch --out OUT
  python benchmarks/dev/diffusion.py --replot OUT/diffusion.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_io import log, med

SHAPE = {  # DiffusionGemma-26B-A4B's text model
    "model_type": "diffusion_gemma_text",
    "vocab_size": 262144,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "moe_intermediate_size": 704,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_global_key_value_heads": 2,
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 1024,
    "num_experts": 128,
    "top_k_experts": 8,
    "max_position_embeddings": 32768,
    "final_logit_softcapping": 30.0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
CANVAS = 256
PROMPT = [(97 * i + 13) % 3000 + 1000 for i in range(64)]


# ---- the checkpoint ------------------------------------------------------------------------
def make_random_checkpoint(
    out: Path, layers: int, bits: int = 4, vocab: int = 0, logit_std: float = 10.0
) -> Path:
    """Random weights written straight in quantized form (packed words, scales, biases) with
    mlx-vlm's DiffusionGemma quantization (8 bits for attention, router, dense MLP and
    embedding; `bits` for the experts), one safetensors file per layer."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.models.diffusion_gemma import Model, ModelConfig

    from devtools.random_checkpoints import QWEN_SPECIALS, word_tokenizer

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    text = {**SHAPE, "num_hidden_layers": layers, "vocab_size": vocab or SHAPE["vocab_size"]}
    text["layer_types"] = (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6 + 1)
    text["layer_types"] = text["layer_types"][:layers]
    text["layer_types"][-1] = "full_attention"
    config = {
        "model_type": "diffusion_gemma",
        "text_config": text,
        "canvas_length": CANVAS,
        "vision_config": None,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    model = Model(ModelConfig.from_dict(config))  # lazy: nothing is materialized
    overrides = {}
    rule = model.quant_predicate

    def choose(path, module):
        r = rule(path, module)
        if isinstance(r, dict):
            overrides[path] = r
        return r

    nn.quantize(model, group_size=64, bits=bits, class_predicate=choose)
    config["quantization"] = {"group_size": 64, "bits": bits, **overrides}
    groups: dict[str, dict] = {}
    for name, p in tree_flatten(model.parameters()):
        parts = name.split(".")
        key = parts[3] if parts[2] == "layers" else "ends"
        groups.setdefault(key, {})[name] = p
    mx.random.seed(0)
    for key, params in groups.items():
        arrays = {}
        for name, p in params.items():
            module_bits = (overrides.get(name.rsplit(".", 1)[0]) or {}).get("bits", bits)
            fan_in = p.shape[-1] * (32 // module_bits) if p.dtype == mx.uint32 else p.shape[-1]
            if p.dtype == mx.uint32:  # packed quantized words: uniform codes
                hi, lo = (mx.random.randint(0, 1 << 16, p.shape).astype(mx.uint32) for _ in "hl")
                arrays[name] = (hi << 16) | lo
            elif name.endswith(".scales"):
                fan = p.shape[-1] * 64
                std_code = ((2**module_bits) ** 2 / 12) ** 0.5
                # weights of std 1/sqrt(fan); the embedding (the head) std logit_std/sqrt(H)
                std = logit_std / SHAPE["hidden_size"] ** 0.5 if "embed" in name else fan**-0.5
                arrays[name] = mx.full(p.shape, std / std_code, mx.bfloat16)
            elif name.endswith(".biases"):
                scale = arrays[name[: -len("biases")] + "scales"]
                arrays[name] = (-(2**module_bits - 1) / 2 * scale).astype(mx.bfloat16)
            elif "embed_tokens" in name:  # also the head: logits of about this spread
                std = logit_std / SHAPE["hidden_size"] ** 0.5
                arrays[name] = (std * mx.random.normal(p.shape)).astype(mx.bfloat16)
            elif p.ndim == 1 or "scalar" in name or "scale" in name:
                arrays[name] = mx.ones(p.shape, mx.bfloat16)
            else:
                arrays[name] = (mx.random.normal(p.shape) / fan_in**0.5).astype(mx.bfloat16)
        mx.eval(arrays)
        mx.save_safetensors(str(out / f"model-{key}.safetensors"), arrays, {"format": "mlx"})
        del arrays
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    word_tokenizer(out, text["vocab_size"], QWEN_SPECIALS, max_length=40960)
    return out


# ---- in one process ------------------------------------------------------------------------
def open_engine(model: Path, rows: int):
    from common.model_parts import load_model_parts
    from coordinator.engine.diffusion.engine import DiffusionEngine
    from coordinator.engine.pipeline import LocalPipeline

    parts = load_model_parts(model)
    return DiffusionEngine(parts, LocalPipeline(parts), rows)


def run_requests(engine, n: int, sampler: str, max_tokens: int, steps: int = 0) -> dict:
    import mlx.core as mx

    from common.generation_params import GenerationParams

    sched = engine.scheduler
    steps0, canvases0, forwards0 = sched.steps_run, sched.canvases_committed, engine.forwards
    mx.synchronize()
    t0 = time.perf_counter()
    seqs = [
        engine.submit(
            PROMPT,
            GenerationParams(
                mode="diffusion", sampler=sampler, max_tokens=max_tokens, seed=i, steps=steps
            ),
        )
        for i in range(n)
    ]
    while engine.has_work:
        engine.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(s.output) for s in seqs)
    steps_run = sched.steps_run - steps0
    canvases = sched.canvases_committed - canvases0
    forwards = engine.forwards - forwards0
    return {
        "wall_s": round(wall, 4),
        "tokens": tokens,
        "tok_s": round(tokens / wall, 2),
        "canvases": canvases,
        "steps_per_canvas": round(steps_run / max(canvases, 1), 2),
        "forwards": forwards,
        "ms_per_forward": round(1000 * wall / max(forwards, 1), 2),
    }


def phase_samplers(engine, args) -> dict:
    rows = {"faithful": [], "turbo": []}
    for sampler in rows:  # compile both paths first
        run_requests(engine, 1, sampler, args.max_tokens, steps=4)
    for r in range(args.repeats):
        for sampler in rows:
            rec = run_requests(engine, 1, sampler, args.max_tokens, args.steps)
            log(f"samplers {r + 1}/{args.repeats} {sampler}: {rec}")
            rows[sampler].append(rec)
    out = {s: _medians(recs) | {"runs": recs} for s, recs in rows.items()}
    out["turbo_vs_faithful_tok_s"] = round(out["turbo"]["tok_s"] / out["faithful"]["tok_s"], 3)
    out["turbo_vs_faithful_ms_per_step"] = round(
        out["faithful"]["ms_per_forward"] / out["turbo"]["ms_per_forward"], 3
    )
    return out


def _medians(recs: list[dict]) -> dict:
    keys = ("tok_s", "steps_per_canvas", "ms_per_forward", "wall_s")
    return {k: med(r[k] for r in recs) for k in keys}


def phase_batch(engine, args) -> dict:
    out: dict = {}
    for sampler in args.batch_samplers:
        for b in args.batch:  # compile each row bucket first
            run_requests(engine, b, sampler, args.max_tokens, steps=3)
        per_b = {}
        for b in args.batch:
            recs = []
            for r in range(args.repeats):
                rec = run_requests(engine, b, sampler, args.max_tokens, args.steps)
                log(f"batch {sampler} B={b} {r + 1}/{args.repeats}: {rec}")
                recs.append(rec)
            per_b[str(b)] = _medians(recs) | {"runs": recs}
        base = per_b[str(args.batch[0])]["tok_s"]
        for b in args.batch:
            per_b[str(b)]["vs_b1"] = round(per_b[str(b)]["tok_s"] / base, 3)
        out[sampler] = per_b
    return out


def phase_split(engine, args) -> dict:
    """Where one denoising step's time goes at B canvases of 256: the layers (one canvas
    forward over a short committed prompt), then the head and each sampler's step (with
    the canvases' state as a first step has it). Synchronized timings, medians."""
    import mlx.core as mx
    import numpy as np

    from common.layer_runner import LayerRunner
    from common.rows_spec import RowsSpec
    from coordinator.engine.diffusion.canvas import new_canvas
    from coordinator.engine.diffusion.reference_sampler import reference_step
    from coordinator.engine.diffusion.turbo import turbo_step

    parts, settings = engine.parts, engine.settings
    out = {}
    for b in args.batch:
        runner = LayerRunner(parts)
        spec = RowsSpec(
            list(range(b)), np.zeros(b, int), np.full(b, CANVAS), np.ones((b, CANVAS), bool),
            np.zeros(b, int), canvas=np.full(b, CANVAS),
        )  # fmt: skip
        tokens = mx.array(np.tile(np.array(PROMPT * 4, np.int32)[:CANVAS], (b, 1)))
        x = parts.embed_canvas(tokens, None)
        mx.eval(x)

        def canvases(n: int = b) -> list:
            return [new_canvas(CANVAS, 48, settings.vocab_size, mx.random.key(i)) for i in range(n)]

        timings: dict[str, list[float]] = {"layers": [], "faithful": [], "turbo": []}
        for rep in range(args.repeats + 1):
            t0 = time.perf_counter()
            h = runner.forward(spec, x)
            mx.eval(h)
            t1 = time.perf_counter()
            cs = canvases()
            logits = parts.softcap(parts.head_logits(h))
            step = reference_step(parts, settings, cs, [0.0] * b, settings.threshold, logits)
            mx.eval(step.arrays(), step.conditioning)
            t2 = time.perf_counter()
            cs = canvases()
            slots = [np.arange(CANVAS)] * b
            step = turbo_step(parts, settings, cs, (1,), parts.head_logits(h), [False] * b, slots)
            mx.eval(step.arrays(), step.conditioning)
            t3 = time.perf_counter()
            runner.release(list(range(b)))
            if rep:  # the first compiles
                timings["layers"].append(t1 - t0)
                timings["faithful"].append(t2 - t1)
                timings["turbo"].append(t3 - t2)
        row = {k: round(1000 * statistics.median(v), 2) for k, v in timings.items()}
        row["step_faithful_ms"] = round(row["layers"] + row["faithful"], 2)
        row["step_turbo_ms"] = round(row["layers"] + row["turbo"], 2)
        log(f"split B={b}: {row}")
        out[str(b)] = row
    return out


# ---- report --------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    s = result.get("samplers")
    if isinstance(s, dict) and "turbo" in s:
        names = ["faithful", "turbo"]
        axes[0].bar(names, [s[n]["tok_s"] for n in names], color=["#888", "#1f77b4"])
        for i, n in enumerate(names):
            axes[0].text(i, s[n]["tok_s"], f"{s[n]['steps_per_canvas']} steps/canvas\n"
                         f"{s[n]['ms_per_forward']} ms/step", ha="center", va="bottom")  # fmt: skip
        axes[0].set_ylim(0, 1.3 * max(s[n]["tok_s"] for n in names))
        axes[0].set_title("single stream, 256-token answers")
        axes[0].set_ylabel("tok/s")
    b = result.get("batch")
    if isinstance(b, dict):
        for sampler, per_b in b.items():
            if not isinstance(per_b, dict):
                continue
            xs = sorted(int(k) for k in per_b)
            axes[1].plot(xs, [per_b[str(x)]["tok_s"] for x in xs], "o-", label=sampler)
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("canvases batched (B)")
        axes[1].set_ylabel("aggregate tok/s")
        axes[1].set_title("batched canvases")
        axes[1].legend()
    fig.suptitle(f"DiffusionGemma-26B-A4B shape, {result.get('layers')} layers, 4-bit, "
                 f"{result.get('device', '')}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=30, help="layers of the 30 to build")
    p.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/dgemma-random"))
    p.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary (smoke runs)")
    p.add_argument(
        "--logit-std",
        type=float,
        default=10.0,
        help="spread of the random head's logits: it sets how confident steps are",
    )
    p.add_argument("--phases", nargs="+", default=["samplers", "batch"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=CANVAS, help="tokens per request")
    p.add_argument("--steps", type=int, default=0, help="steps per canvas (0: the model's)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch-samplers", nargs="+", default=["turbo", "faithful"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="diffusion")
    p.add_argument("--replot", type=Path)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.replot:
        result = json.loads(args.replot.read_text())
        plot(result, args.replot.with_suffix(".png"))
        return
    import mlx.core as mx

    args.out.mkdir(parents=True, exist_ok=True)
    info = mx.device_info() if mx.default_device().type == mx.gpu else {}
    result: dict = {
        "layers": args.layers,
        "device": str(info.get("device_name", mx.default_device())),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
    }
    t0 = time.perf_counter()
    name = f"l{args.layers}-std{args.logit_std:g}" + (f"-v{args.vocab}" if args.vocab else "")
    model = make_random_checkpoint(
        args.ckpt_dir / name, args.layers, vocab=args.vocab, logit_std=args.logit_std
    )
    result["logit_std"] = args.logit_std
    result["checkpoint_s"] = round(time.perf_counter() - t0, 1)
    log(f"checkpoint ready in {result['checkpoint_s']} s")
    engine = None
    for phase in args.phases:
        try:
            if engine is None:
                engine = open_engine(model, max(args.batch))
            fn = {
                "samplers": phase_samplers,
                "batch": phase_batch,
                "split": phase_split,
            }[phase]
            result[phase] = fn(engine, args)
        except Exception as e:
            traceback.print_exc()
            result[phase] = {"error": f"{type(e).__name__}: {e}"}
        (args.out / f"{args.name}.partial.json").write_text(json.dumps(result, indent=1))
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    try:
        plot(result, path.with_suffix(".png"))
    except ImportError:
        log("matplotlib is not installed here: plot with --replot")


if __name__ == "__main__":
    main()
