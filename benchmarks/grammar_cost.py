"""Structured output's cost: grammar-constrained decoding (a JSON schema, llguidance)
against unconstrained decoding on one model, single-process engine, C concurrent streams.
Prints one JSON object.

Per C: wall time per committed token, unconstrained AR, constrained (AR: constrained
requests decode one grammar-checked token per forward in every mode), and unconstrained
WeDLM with its tokens per forward; and the mask's own host cost per token (llguidance's
bitmask fill and token consumption, replayed over the constrained outputs).

  python benchmarks/grammar_cost.py --model default --concurrency 1 8 --tokens 48
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
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)], chat=True) for i in range(concurrency)]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    local = open_local_engine(args.model, num_rows=max(args.concurrency))
    grammars = local.engine.grammars
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    grammars.check(grammar)
    run(local, 1, 4, mode="ar")  # warm-up: kernels, the llguidance tokenizer
    run(local, 1, 4, mode="ar", grammar=grammar)
    results = []
    for c in args.concurrency:
        free = run(local, c, args.tokens, mode="ar")
        constrained = run(local, c, args.tokens, mode="ar", grammar=grammar)
        wedlm = run(local, c, args.tokens, mode="wedlm")
        overhead = constrained["ms_per_token"] / free["ms_per_token"] - 1
        results.append({
            "concurrency": c,
            "ar_ms_per_token": free["ms_per_token"],
            "constrained_ms_per_token": constrained["ms_per_token"],
            "overhead_pct": round(100 * overhead, 1),
            "mask_host_ms_per_token": mask_cost(grammars, grammar, constrained["outputs"]),
            "wedlm_ms_per_token": wedlm["ms_per_token"],
            "wedlm_tokens_per_forward": wedlm["tokens_per_forward"],
            "constrained_tokens_per_forward": constrained["tokens_per_forward"],
        })  # fmt: skip
    print(json.dumps({"model": args.model, "vocab": grammars.vocab_size, "tokens": args.tokens,
                      "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
