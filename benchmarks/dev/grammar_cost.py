"""Structured output's cost: grammar-constrained decoding (a JSON schema, llguidance)
against unconstrained decoding on one model, single-process engine, C concurrent streams.
Prints one JSON object.

Per C: wall time per committed token, unconstrained and constrained AR, and (on a model
with a mask token) unconstrained and constrained WeDLM with their tokens per forward
(constrained WeDLM keeps its parallel commits: coordinator/engine/constrained.py); and
the mask's own host cost per token (llguidance's
bitmask fill and token consumption), replayed over the constrained outputs and over a
schema-valid document in a large vocabulary (--mask-tokenizer: SmolLM2's 49,152 tokens).

  python benchmarks/dev/grammar_cost.py --model ../shared/models/stories260K --concurrency 1 8
"""

from __future__ import annotations

import argparse
import json
import time

import llguidance
import llguidance.numpy

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from coordinator.http_api.response_format import JSON_OPTIONS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON.", "Give me a JSON record of a traveller.",
           "A JSON profile of a chess player, please.",
           "Invent a customer record in JSON."]  # fmt: skip


def run(local, concurrency: int, tokens: int, **kw) -> dict:
    engine, tokenizer = local.engine, local.tokenizer
    chat = tokenizer.has_chat_template
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)], chat=chat) for i in range(concurrency)]
    params = GenerationParams(max_tokens=tokens, **kw)
    start = time.perf_counter()
    seqs = [engine.submit(p, params) for p in prompts]
    for _ in engine.stream(seqs):
        pass
    wall = time.perf_counter() - start
    committed = sum(len(s.output) for s in seqs)
    forwards = sum(s.forwards for s in seqs)
    return {"ms_per_token": round(1000 * wall / committed, 3), "tokens": committed,
            "tokens_per_forward": round(committed / max(forwards, 1), 2),
            "outputs": [s.output for s in seqs]}  # fmt: skip


def mask_cost(grammars, grammar: str, outputs: list[list[int]]) -> float:
    """Host milliseconds per token of llguidance's bitmask fill and consume."""
    bitmask = llguidance.numpy.allocate_token_bitmask(1, grammars.vocab_size)
    spent, count = 0.0, 0
    for output in outputs:
        matcher = grammars.matcher(grammar)
        for token in output:
            t = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
            matcher.consume_token(token)
            spent += time.perf_counter() - t
            count += 1
    return round(1000 * spent / max(count, 1), 4)


DOCUMENT = ('{"name":"Ada Lovelace","age":36,"city":"London","tags":["math","poetry",'
            '"engines"]}')


def replay_cost(model: str) -> dict:
    """The mask's host cost per token with another (larger) tokenizer, replaying a
    schema-valid document's tokens."""
    from common.model_config import load_model_config
    from common.tokenizer import Tokenizer
    from coordinator.engine.constrained import Grammars

    tokenizer = Tokenizer(model)
    config = load_model_config(model)
    grammars = Grammars(tokenizer, config.vocab_size, tokenizer.stop_ids)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    ids = tokenizer.encode(DOCUMENT)
    cost = min(mask_cost(grammars, grammar, [ids]) for _ in range(5))
    return {"tokenizer": model, "vocab": config.vocab_size, "tokens": len(ids),
            "mask_host_ms_per_token": cost}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="../shared/models/stories260K")
    ap.add_argument("--mask-tokenizer", default="../shared/models/wedlm-smollm2-135m-r2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    local = open_local_engine(args.model, num_rows=max(args.concurrency))
    grammars = local.engine.grammars
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    grammars.check(grammar)
    wedlm = local.engine.config.mask_token_id < local.engine.config.vocab_size
    for c in args.concurrency:  # warm-up: every shape's kernels, the llguidance tokenizer
        for kw in ({}, {"grammar": grammar}):
            run(local, c, args.tokens, mode="ar", **kw)
        if wedlm:
            for kw in ({}, {"grammar": grammar}):
                run(local, c, args.tokens, mode="wedlm", **kw)
    results = []
    for c in args.concurrency:
        free = run(local, c, args.tokens, mode="ar")
        constrained = run(local, c, args.tokens, mode="ar", grammar=grammar)
        parallel = run(local, c, args.tokens, mode="wedlm") if wedlm else {}
        held = run(local, c, args.tokens, mode="wedlm", grammar=grammar) if wedlm else {}
        overhead = constrained["ms_per_token"] / free["ms_per_token"] - 1
        results.append({
            "concurrency": c,
            "ar_ms_per_token": free["ms_per_token"],
            "constrained_ms_per_token": constrained["ms_per_token"],
            "overhead_pct": round(100 * overhead, 1),
            "mask_host_ms_per_token": mask_cost(grammars, grammar, constrained["outputs"]),
            "wedlm_ms_per_token": parallel.get("ms_per_token"),  # None: no mask token
            "wedlm_tokens_per_forward": parallel.get("tokens_per_forward"),
            "constrained_wedlm_ms_per_token": held.get("ms_per_token"),
            "constrained_wedlm_tokens_per_forward": held.get("tokens_per_forward"),
            "constrained_tokens_per_forward": constrained["tokens_per_forward"],
        })  # fmt: skip
    print(json.dumps({"model": args.model, "vocab": grammars.vocab_size, "tokens": args.tokens,
                      "results": results, "large_vocab": replay_cost(args.mask_tokenizer)},
                     indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
