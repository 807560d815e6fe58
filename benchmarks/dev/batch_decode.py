"""Batched autoregressive decode in one process: this engine versus mlx-lm's
BatchGenerator on the same weights, B sequences decoding together (prompts of different
lengths, so every row has its own KV length), steady state, no arrivals. Isolates the
engine's batched step from the serving path (gRPC, worker hops, arriving prefills).
Prints one JSON object and writes batch_decode.json to --out.

  python benchmarks/dev/batch_decode.py --model random-qwen3-8b --batch 1 16 32
  python benchmarks/dev/batch_decode.py --model default --batch 1 8 --tokens 24
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import mlx.nn as nn
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_io import add_random_shape_flags, finish, run_info
from benchmarks.dev.engine import mlx_lm_model, random_qwen3
from common import model_parts
from common.generation_params import GenerationParams
from common.model_parts import ModelParts, load_model_parts
from coordinator.engine.engine import Engine
from coordinator.engine.local_engine import resolve_model
from coordinator.engine.pipeline import LocalPipeline
from coordinator.engine.sequence import Phase

DEFAULT_CHUNK = model_parts.LAUNCH_EVERY
SKIP = 4  # first decode steps of a run are not measured (new shapes)
now = time.perf_counter


def prompts_for(batch: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    high = min(vocab, 5000)
    return [[int(t) for t in rng.integers(high // 10, high, 24 + 5 * i)] for i in range(batch)]


def engine_steps(engine: Engine, prompts: list[list[int]], n: int) -> dict:
    params = GenerationParams(mode="ar", max_tokens=n, temperature=0.0)
    seqs = [engine.submit(p, params) for p in prompts]
    for s in seqs:
        s.params = dataclasses.replace(s.params, extra_stop_ids=(), stop_ids=())
    steps, forwards = [], 0
    while engine.has_work:
        all_decoding = all(s.phase is Phase.DECODE for s in seqs)
        before = engine.forwards
        start = now()
        engine.step()
        if all_decoding and engine.forwards > before and not any(s.finished for s in seqs):
            steps.append(now() - start)
        forwards += engine.forwards - before
    assert all(len(s.output) == n for s in seqs), "every row decodes n tokens"
    return {"step_ms": 1e3 * statistics.median(steps[SKIP:]), "steps": len(steps)}


def mlxlm_steps(model: nn.Module, prompts: list[list[int]], n: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    b = len(prompts)
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=[], completion_batch_size=b,
                         prefill_batch_size=b)  # fmt: skip
    gen.insert(prompts)
    steps, counts, started = [], [], False
    while True:
        start = now()
        responses = gen.next_generated()
        dt = now() - start
        if not responses:
            break
        if started and len(responses) == b and all(r.finish_reason is None for r in responses):
            steps.append(dt)
        started = started or len(responses) == b
        counts.append(len(responses))
        if all(r.finish_reason is not None for r in responses):
            break
    gen.close()
    return {"step_ms": 1e3 * statistics.median(steps[SKIP:]), "steps": len(steps)}


def bench(
    parts: ModelParts, mlm: nn.Module, batches: list[int], repeats: int, n: int, chunks: list[int]
) -> dict:
    """Per batch size: mlx-lm, then the engine with each graph-launch chunking, rotated."""
    out = {}
    for b in batches:
        engine = Engine(parts, LocalPipeline(parts), b)
        prompts = prompts_for(b, parts.config.vocab_size)
        runs: dict[str, list[float]] = {"mlxlm": [], **{f"engine_{c}": [] for c in chunks}}
        for r in range(repeats + 1):  # A B C A B C ...; round 0 warms up
            for name in runs:
                if name == "mlxlm":
                    ms = mlxlm_steps(mlm, prompts, n)["step_ms"]
                else:
                    model_parts.LAUNCH_EVERY = int(name.split("_")[1])
                    ms = engine_steps(engine, prompts, n)["step_ms"]
                if r:
                    runs[name].append(ms)
        med = {k: statistics.median(v) for k, v in runs.items()}
        out[str(b)] = {
            **{f"{k}_step_ms": v for k, v in med.items()},
            **{f"{k}_over_mlxlm_throughput": med["mlxlm"] / v
               for k, v in med.items() if k != "mlxlm"},
            "runs_ms": runs,
        }  # fmt: skip
        print(f"B={b}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()), flush=True)
    model_parts.LAUNCH_EVERY = DEFAULT_CHUNK
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_shape_flags(ap)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--launch-every", type=int, nargs="+", default=[DEFAULT_CHUNK],
        help="engine variants: layers per launched graph chunk (0 = one launch)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if args.model == "random-qwen3-8b":
        parts, mlm = random_qwen3(args.layers, args.hidden)
        name = f"random-qwen3-8b(layers={args.layers},hidden={args.hidden})"
    else:
        parts = load_model_parts(resolve_model(args.model))
        mlm, name = mlx_lm_model(parts), args.model
    result = run_info(model=name, tokens=args.tokens, repeats=args.repeats)
    result["batches"] = bench(parts, mlm, args.batch, args.repeats, args.tokens,
                              args.launch_every)  # fmt: skip
    finish(result, args.out, "batch_decode")


if __name__ == "__main__":
    main()
