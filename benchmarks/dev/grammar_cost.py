"""Structured output's cost: grammar-constrained decoding (a JSON schema, llguidance)
against unconstrained decoding on one model, single-process engine, C concurrent streams.
Prints one JSON object.

The schema is a long array of short strings, so a constrained answer cannot close before
max_tokens and both runs decode the same number of tokens. Times are of the steady decode
window (every row past its prompt, none finished: C rows in every forward, no prefill);
the whole run's (e2e_*) are printed beside.

Per C and mode (AR, and WeDLM on a model with a mask token): wall time per committed
token unconstrained and constrained, the overhead, tokens per decode forward of both
(constrained WeDLM keeps its parallel commits: coordinator/engine/constrained.py), and
the mask's own host time inside the window (constrained.fill_masks, the bitmask fill of
every constrained row, and apply_masks, the upload and expansion queued on the device)
per token and as a share of the window. --ahead adds constrained runs on the overlapped
path (the engine's fill_ahead and constrained_ahead: the fill on a thread overlapping
the engine's other work, constrained WeDLM rows launched ahead, dropped where the grammar
cuts a run they were built from), with the look-ahead forwards dropped; on an H100 it
cost more than the default inline path (RESULTS.md GC2). Then the mask's host cost per token
replayed over a schema-valid document prefix in a large vocabulary (--mask-tokenizer:
SmolLM2's 49,152 tokens), one row and C rows filled together.

  python benchmarks/dev/grammar_cost.py                      # r2 checkpoint, C = 1 and 32
  python benchmarks/dev/grammar_cost.py --dry-run            # seconds: tiny sizes, one run
  python benchmarks/dev/grammar_cost.py --model ../shared/models/stories260K --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import json
import time

import llguidance
import llguidance.numpy

from common.generation_params import GenerationParams
from coordinator.engine import constrained
from coordinator.engine.local_engine import open_local_engine
from coordinator.http_api.response_format import JSON_OPTIONS

# A long array of short strings: the JSON cannot close before max_tokens, so every
# constrained row decodes as long as an unconstrained one and the mask's per-token cost is
# measured over the same steps (a small schema closes early: fewer rows per step, prefill
# spread over fewer tokens).
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                  "minItems": 256},
    },
    "required": ["items"],
    "additionalProperties": False,
}  # fmt: skip
PROMPTS = ["Describe a person as JSON.", "Give me a JSON record of a traveller.",
           "A JSON profile of a chess player, please.",
           "Invent a customer record in JSON."]  # fmt: skip


class MaskClock:
    """Host seconds spent on the grammar masks: constrained.fill_masks (the matchers'
    bitmasks; on the grammars' thread, overlapping the engine thread's work, unless the
    engine fills inline) and apply_masks (upload, expansion queued). The engine calls
    both through the module."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("fill_masks", "apply_masks"):
            setattr(constrained, name, self._timed(getattr(constrained, name)))

    def _timed(self, inner):
        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t

        return timed


def run(local, clock: MaskClock, concurrency: int, tokens: int, **kw) -> dict:
    """One batch of `concurrency` requests. Timed over its steady decode window: from the
    step after which every row has its first token (prefills done) to the step where the
    first row finishes, so every step of it decodes all `concurrency` rows and nothing of
    the prompts' forwards (TTFT) is counted."""
    engine, tokenizer = local.engine, local.tokenizer
    chat = tokenizer.has_chat_template
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)], chat=chat) for i in range(concurrency)]
    params = GenerationParams(max_tokens=tokens, **kw)
    clock.seconds = 0.0
    start = time.perf_counter()
    seqs = [engine.submit(p, params) for p in prompts]
    first = last = None  # (time, tokens, forwards, mask seconds, drops) at the window's ends
    while any(not s.finished for s in seqs):
        engine.step()
        now = (time.perf_counter(), sum(len(s.output) for s in seqs),
               sum(s.forwards for s in seqs), clock.seconds, engine.ahead_dropped)  # fmt: skip
        if first is None and all(s.output for s in seqs):
            first = now
        elif first is not None and last is None and any(s.finished for s in seqs):
            last = now
    wall = time.perf_counter() - start
    committed = sum(len(s.output) for s in seqs)
    if first is None or last is None or last[1] == first[1]:
        first = (start, 0, 0, 0.0, 0)  # too short for a steady window: the whole run
        last = (start + wall, committed, sum(s.forwards for s in seqs), clock.seconds, 0)
    seconds, count = last[0] - first[0], last[1] - first[1]
    return {"ms_per_token": 1000 * seconds / count, "tokens": count,
            "tokens_per_forward": round(count / max(last[2] - first[2], 1), 2),
            "mask_ms_per_token": 1000 * (last[3] - first[3]) / count,
            "mask_share_pct": 100 * (last[3] - first[3]) / seconds,
            "dropped_lookaheads": last[4] - first[4],
            "e2e_ms_per_token": 1000 * wall / committed, "e2e_tokens": committed,
            "outputs": [s.output for s in seqs]}  # fmt: skip


def best(local, clock: MaskClock, repeats: int, *args, **kw) -> dict:
    """The run with the median wall time per token of `repeats`."""
    runs = sorted((run(local, clock, *args, **kw) for _ in range(repeats)),
                  key=lambda r: r["ms_per_token"])  # fmt: skip
    return runs[len(runs) // 2]


def compare(local, clock: MaskClock, repeats: int, c: int, tokens: int, grammar: str,
            overlapped: bool, **kw) -> tuple[dict, list[list[int]]]:  # fmt: skip
    """Unconstrained against constrained decoding in one mode at concurrency c, on the
    engine's default path (masks filled inline, constrained WeDLM rows never launched
    ahead); with `overlapped` (--ahead), on the overlapped path too (the engine's
    fill_ahead and constrained_ahead on: the fill on the grammars' thread, constrained
    WeDLM rows launched ahead), reported as `ahead_*`."""
    free = best(local, clock, repeats, c, tokens, **kw)
    held = best(local, clock, repeats, c, tokens, grammar=grammar, **kw)
    overhead = held["ms_per_token"] / free["ms_per_token"] - 1
    out = {"ms_per_token": round(free["ms_per_token"], 3),
           "constrained_ms_per_token": round(held["ms_per_token"], 3),
           "overhead_pct": round(100 * overhead, 1),
           "tokens_per_forward": free["tokens_per_forward"],
           "constrained_tokens_per_forward": held["tokens_per_forward"],
           "decode_tokens": free["tokens"], "constrained_decode_tokens": held["tokens"],
           "e2e_ms_per_token": round(free["e2e_ms_per_token"], 3),
           "constrained_e2e_ms_per_token": round(held["e2e_ms_per_token"], 3),
           "mask_host_ms_per_token": round(held["mask_ms_per_token"], 4),
           "mask_share_pct": round(held["mask_share_pct"], 1)}  # fmt: skip
    if overlapped:
        engine = local.engine
        engine.fill_ahead = engine.constrained_ahead = True
        try:
            ahead = best(local, clock, repeats, c, tokens, grammar=grammar, **kw)
        finally:
            engine.fill_ahead = engine.constrained_ahead = False
        out["ahead_same_output"] = ahead["outputs"] == held["outputs"]
        out["ahead_constrained_ms_per_token"] = round(ahead["ms_per_token"], 3)
        out["ahead_overhead_pct"] = round(
            100 * (ahead["ms_per_token"] / free["ms_per_token"] - 1), 1
        )
        out["ahead_constrained_tokens_per_forward"] = ahead["tokens_per_forward"]
        out["ahead_mask_share_pct"] = round(ahead["mask_share_pct"], 1)
        out["ahead_dropped_lookaheads"] = ahead["dropped_lookaheads"]
    return out, held["outputs"]


def mask_cost(grammars, grammar: str, outputs: list[list[int]]) -> float:
    """Host milliseconds per token of llguidance's bitmask fill and consume, one row."""
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


def rows_cost(grammars, grammar: str, ids: list[int], rows: int) -> dict:
    """Host milliseconds per row-token of filling `rows` matchers' masks for each step of
    `ids`: one after another, and together on llguidance's threads (the engine's fill)."""
    table = llguidance.numpy.allocate_token_bitmask(rows, grammars.vocab_size)
    executor = llguidance.LLExecutor()
    timings = {}
    for name in ("one_by_one", "together"):
        matchers = [grammars.matcher(grammar) for _ in range(rows)]
        t = time.perf_counter()
        for token in ids:
            if name == "together":
                jobs = [(m, i) for i, m in enumerate(matchers)]
                llguidance.numpy.fill_next_token_bitmask_par(executor, jobs, table)
            else:
                for i, m in enumerate(matchers):
                    llguidance.numpy.fill_next_token_bitmask(m, table, i)
            for m in matchers:
                m.consume_token(token)
        timings[name] = round(1000 * (time.perf_counter() - t) / (rows * len(ids)), 4)
    return timings


WORDS = ["math", "poetry", "engines", "London", "Ada", "numbers", "looms", "cards"]
DOCUMENT = '{"items":[' + ",".join(f'"{w}"' for w in WORDS * 4)  # a prefix SCHEMA allows


def replay_cost(model: str, rows: int) -> dict:
    """The mask's host cost per token with another (larger) tokenizer, replaying a
    schema-valid document prefix's tokens: one row, and `rows` rows per step."""
    from common.model_config import load_model_config
    from common.tokenizer import Tokenizer
    from coordinator.engine.constrained import Grammars

    tokenizer = Tokenizer(model)
    config = load_model_config(model)
    grammars = Grammars(tokenizer, config.vocab_size, tokenizer.stop_ids)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    ids = tokenizer.encode(DOCUMENT)
    cost = min(mask_cost(grammars, grammar, [ids]) for _ in range(5))
    batched = [rows_cost(grammars, grammar, ids, rows) for _ in range(3)]
    per_row = {k: min(b[k] for b in batched) for k in batched[0]}
    return {"tokenizer": model, "vocab": config.vocab_size, "tokens": len(ids),
            "mask_host_ms_per_token": cost, "rows": rows,
            "rows_ms_per_row_token": per_row}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="../shared/models/wedlm-smollm2-135m-r2")
    ap.add_argument("--mask-tokenizer", default="../shared/models/wedlm-smollm2-135m-r2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per point (the median)")
    ap.add_argument("--threshold", type=float, default=None, help="WeDLM's (engine default)")
    quick = "tiny sizes (C = 1 and 2, 8 tokens, one run): check that it runs"
    ap.add_argument("--dry-run", action="store_true", help=quick)
    ahead = "also constrained on the overlapped path (fill on a thread, WeDLM rows ahead)"
    ap.add_argument("--ahead", action="store_true", help=ahead)
    args = ap.parse_args()
    if args.dry_run:
        args.concurrency, args.tokens, args.repeats = [1, 2], 8, 1
    local = open_local_engine(args.model, num_rows=max(args.concurrency))
    grammars = local.engine.grammars
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    grammars.check(grammar)
    config = local.engine.config
    modes = {"ar": {"mode": "ar"}}
    if 0 <= config.mask_token_id < config.vocab_size:
        wedlm = {"threshold": args.threshold} if args.threshold is not None else {}
        modes["wedlm"] = {"mode": "wedlm", **wedlm}
    clock = MaskClock()
    for c in args.concurrency:  # warm-up: every shape's kernels, the llguidance tokenizer
        for kw in modes.values():
            compare(local, clock, 1, c, args.tokens, grammar, args.ahead, **kw)
    results = []
    for c in args.concurrency:
        point: dict = {"concurrency": c}
        outputs: list[list[int]] = []
        for name, kw in modes.items():
            point[name], outputs = compare(local, clock, args.repeats, c, args.tokens, grammar,
                                           args.ahead, **kw)  # fmt: skip
        point["replayed_mask_host_ms_per_token"] = mask_cost(grammars, grammar, outputs)
        results.append(point)
    large = replay_cost(args.mask_tokenizer, max(args.concurrency))
    print(json.dumps({"model": args.model, "vocab": grammars.vocab_size, "tokens": args.tokens,
                      "repeats": args.repeats, "modes": list(modes), "results": results,
                      "large_vocab": large}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
