"""The mlx-lm side of benchmarks/dev/serve.py's closed loop: the same loop on mlx-lm's
BatchGenerator, in process, greedy AR, the same prompts, max_tokens and stop ids,
with C sequences kept in the batch (when one finishes the next is inserted). Run as a
module it prints one JSON object (per level); serve.py runs it in a subprocess.

  python -m benchmarks.dev.serve_mlxlm --model PATH --concurrency 1 2 4 --max-tokens 24
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

from wedlm_client.bench.records import PROMPTS, Rec, Schedule, now, summarize

ROOT = Path(__file__).resolve().parents[2]


def level(model, prompts: list[list[int]], stops: list[int], c: int, args) -> dict:
    """One concurrency level; a token's time is when BatchGenerator hands it back."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=args.max_tokens, stop_tokens=[[t] for t in stops],
                         completion_batch_size=c, prefill_batch_size=c)  # fmt: skip
    schedule = Schedule(args.duration, args.requests, args.warmup)
    recs: list[Rec] = []
    live: dict[int, Rec] = {}
    order = itertools.count()

    def insert() -> None:
        if (rec := schedule.next()) is not None:
            live[gen.insert([prompts[next(order) % len(prompts)]])[0]] = rec

    for _ in range(c):
        insert()
    while live:
        responses = gen.next_generated()
        t = now()
        finished = 0
        for r in responses:
            rec = live[r.uid]
            rec.events.append((t, 1))  # a stop token counts, as in the engine's output
            if r.finish_reason is not None:
                rec.end = t
                rec.final = {"tokens_per_forward": 1.0, "forwards": len(rec.events)}
                recs.append(live.pop(r.uid))
                finished += 1
        for _ in range(finished):  # the closed loop: each finished request's next
            insert()
    gen.close()
    stats = summarize(recs, schedule.window)
    print(f"  mlx-lm C={c}: {stats['tok_s']} tok/s, TTFT p50 {stats['ttft_ms_p50']} ms",
          file=sys.stderr)  # fmt: skip
    return stats


def sweep_in_subprocess(model: Path, args) -> dict:
    """Its own process, so its weights and KV are gone before the cluster starts."""
    cmd = [sys.executable, "-m", "benchmarks.dev.serve_mlxlm", "--model", str(model),
           "--max-tokens", str(args.max_tokens), "--duration", str(args.duration),
           "--requests", str(args.requests), "--warmup", str(args.warmup),
           "--concurrency", *map(str, args.concurrency)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    sys.stderr.write(out.stderr[-4000:])
    if out.returncode != 0:
        raise RuntimeError(f"the mlx-lm sweep failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import mlx.core as mx

    from benchmarks.dev.engine import mlx_lm_model
    from common.model_parts import load_model_parts
    from common.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=2.0)
    args = ap.parse_args()
    if args.requests:
        args.duration = 0.0
    parts = load_model_parts(args.model)  # the engine's dtype rules (fp32 on a CPU)
    model = mlx_lm_model(parts)  # mlx-lm's model around the very same weights
    mx.eval(model.parameters())
    tok = Tokenizer(args.model)
    stops = sorted(set(parts.config.eos_token_ids) | set(tok.stop_ids))
    prompts = [tok.encode(p) for p in PROMPTS]  # what the coordinator makes of the text
    print(json.dumps({str(c): level(model, prompts, stops, c, args) for c in args.concurrency}))


if __name__ == "__main__":
    main()
