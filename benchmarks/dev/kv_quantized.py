"""Quantized KV (--kv-bits) against the model's dtype, one process. Prints one JSON object
and writes kv_quantized.json to --out.

- memory: KV bytes per token at 16 (the model's dtype) / 8 / 4 bits, from the stores'
  actual buffers after a prefill (and the formula's value beside them);
- agreement: greedy AR outputs of --tokens tokens for the chat prompts, at 8 and 4 bits,
  against the model's dtype: the fraction of positions equal up to the first divergence
  and in all (the target is >= 0.95 at 8 bits);
- speed: decode tok/s of one sequence at each --contexts (a random prompt of that many
  tokens prefilled first), medians of --repeats, at each KV width. A context past the
  model's own (the default model has 8,192 positions) runs on a copy whose config allows
  it (the weights are linked, not copied): the text there is meaningless, the speed is not.

  python benchmarks/dev/kv_quantized.py --model default --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx
import numpy as np

from common.generation_params import GenerationParams
from common.kv_format import KVFormat
from coordinator.engine.local_engine import open_local_engine, resolve_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a computer network is.",
    "Give me three tips for sleeping well.",
]
WIDTHS = {"16": None, "8": 8, "4": 4}


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def generate(local, prompt: list[int], n: int) -> tuple[list[int], float]:
    seq = local.engine.submit(prompt, GenerationParams(mode="ar", max_tokens=n))
    for _ in local.engine.stream([seq]):
        pass
    return seq.output, (len(seq.output) - 1) / seq.decode_s if seq.decode_s else 0.0


def stretched(model: Path, positions: int) -> Path:
    """The model folder, or a linked copy whose config allows `positions` positions."""
    config = json.loads((model / "config.json").read_text())
    if config.get("max_position_embeddings", 0) >= positions:
        return model
    copy = Path(tempfile.mkdtemp(prefix="kv-stretched-"))
    for f in model.iterdir():
        if f.name != "config.json":
            (copy / f.name).symlink_to(f.resolve())
    config["max_position_embeddings"] = positions
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384])
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/kv"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": str(mx.default_device()), "date": time.strftime("%Y-%m-%d"),
                    "command": " ".join(sys.argv), "model": args.model}  # fmt: skip
    engines = {k: open_local_engine(args.model, kv=KVFormat(b, args.group_size))
               for k, b in WIDTHS.items()}  # fmt: skip
    longest = max(args.contexts) + args.speed_tokens + 16
    fast = {k: open_local_engine(stretched(resolve_model(args.model), longest),
                                 kv=KVFormat(b, args.group_size))
            for k, b in WIDTHS.items()}  # fmt: skip
    tok = engines["16"].tokenizer
    prompts = [tok.encode(t, chat=True) for t in PROMPTS]
    # memory: bytes per token as each store keeps them (the tests check the buffers)
    memory = {}
    for k, local in engines.items():
        runner = local.engine.pipeline.runner
        layers = len(runner.parts.layers)
        dtype = runner.parts.embed_tokens.weight.dtype
        memory[k] = {"formula_bytes_per_token": runner.kv.bytes_per_token(
            runner.parts.config, dtype, layers)}  # fmt: skip
    base = memory["16"]["formula_bytes_per_token"]
    for m in memory.values():
        m["vs_16"] = round(m["formula_bytes_per_token"] / base, 4)
    result["memory"] = memory
    log("agreement")
    outs = {
        k: [generate(local, q, args.tokens)[0] for q in prompts] for k, local in engines.items()
    }
    agreement = {}
    for k in ("8", "4"):
        same, prefix, total = 0, 0, 0
        for ref, got in zip(outs["16"], outs[k], strict=True):
            n = min(len(ref), len(got))
            same += sum(a == b for a, b in zip(ref[:n], got[:n], strict=True))
            first = next((i for i in range(n) if ref[i] != got[i]), n)
            prefix += first
            total += len(ref)
        agreement[k] = {"positions_equal": round(same / total, 4),
                        "equal_before_first_divergence": round(prefix / total, 4)}  # fmt: skip
    result["agreement"] = agreement
    speed: dict = {}
    vocab = engines["16"].engine.config.vocab_size
    for ctx in args.contexts:
        prompt = np.random.default_rng(ctx).integers(100, vocab - 100, ctx).tolist()
        rows: dict[str, list[float]] = {k: [] for k in fast}
        for _ in range(args.repeats):
            for k, local in fast.items():
                log(f"speed: context {ctx}, {k} bits")
                rows[k].append(generate(local, prompt, args.speed_tokens)[1])
        med = {k: round(statistics.median(v), 2) for k, v in rows.items()}
        speed[str(ctx)] = {
            k: {"tok_s": v, "vs_16": round(v / med["16"], 3)} for k, v in med.items()
        }
    result["speed"] = speed
    (args.out / "kv_quantized.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
