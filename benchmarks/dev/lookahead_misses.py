"""Which decode forwards miss AR's look-ahead, per mode (issue 35): counts, not times.

On MLX-CUDA a forward launched before the previous one's read-back hides its host work
behind the device's; one launched after the read-back (a drafting forward, whose inputs
depend on the tokens just read) pays for it. This runs greedy requests in one process with
the draft break-even fixed (so the decisions do not depend on this machine's timing) and
counts each completed decode forward by width (one row per sequence, or wider: drafts or
mask slots) and by whether the forward after it was launched ahead. Prompts: the chat or
counting set of speculative.py; AR, speculative with mask drafts (W 8) and WeDLM (W 16,
tau 0.6, as speculative.py runs them).

  python benchmarks/dev/lookahead_misses.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_io import figure, finish, finish_axes, run_info, save_figure
from benchmarks.dev.speculative import CHAT, COUNTING, WEDLM_MODEL
from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.sequence import Phase

KINDS = ("one row, ahead", "one row, read back first", "wide, ahead", "wide, read back first")


def count(local, prompts: list[list[int]], params: GenerationParams, concurrency: int) -> dict:
    """Decode forwards by kind, and the requests' tokens, for one mode and concurrency."""
    engine = local.engine
    complete, kinds = engine._complete, Counter()

    def counted(commits):
        ran = complete(commits)
        if ran is not None and all(p.seq.phase is Phase.DECODE for p in ran.flight.plans):
            wide = max(p.width for p in ran.flight.plans) > 1
            kinds[KINDS[2 * wide + (not ran.ahead)]] += 1
        return ran

    engine._complete = counted
    tokens, per_request = 0, []
    try:
        for start in range(0, len(prompts), concurrency):
            seqs = [engine.submit(p, params) for p in prompts[start : start + concurrency]]
            for _ in engine.stream(seqs):
                pass
            tokens += sum(len(s.output) for s in seqs)
            per_request += [[len(s.output), s.forwards] for s in seqs]
    finally:
        engine._complete = complete
    forwards = sum(kinds.values())
    return {
        "decode_forwards": forwards,
        "tokens": tokens,
        # each request's tokens and forwards: a closed batch lasts as long as its slowest
        "per_request_tokens_forwards": per_request,
        "by_kind": {k: kinds[k] for k in KINDS},
        "read_back_first_fraction": round(
            (kinds[KINDS[1]] + kinds[KINDS[3]]) / max(forwards, 1), 3
        ),
    }


def plot(result: dict, path: Path) -> None:
    made = figure(1, f"decode forwards by kind, {result['prompts']} prompts")
    if made is None:
        return
    fig, (ax,) = made
    names = list(result["runs"])
    bottom = [0] * len(names)
    for kind in KINDS:
        values = [result["runs"][n]["by_kind"][kind] for n in names]
        ax.bar(names, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    finish_axes(ax, "mode / concurrency", "decode forwards")
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=WEDLM_MODEL)
    ap.add_argument("--prompts", choices=("chat", "counting"), default="chat")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--break-even", type=float, default=1.5)
    ap.add_argument("--modes", nargs="+", default=["ar", "speculative", "wedlm"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/lookahead_misses"))
    args = ap.parse_args()
    local = open_local_engine(args.model, num_rows=max(args.concurrency))
    local.engine.step_cost.online = False
    rows = range(1, max(args.concurrency) + 1)
    local.engine.step_cost.seed({r: args.break_even for r in rows})
    chat = args.prompts == "chat"
    texts = (CHAT if chat else COUNTING)[: args.requests]
    prompts = [local.tokenizer.encode(t, chat=chat) for t in texts]
    modes = {
        "ar": GenerationParams(mode="ar", max_tokens=args.max_tokens),
        "speculative": GenerationParams(
            mode="speculative", draft="mask", window=8, max_tokens=args.max_tokens
        ),
        "wedlm": GenerationParams(
            mode="wedlm", window=16, threshold=0.6, max_tokens=args.max_tokens
        ),
    }
    result = run_info(model=str(args.model), prompts=args.prompts, break_even=args.break_even)
    result["runs"] = {
        f"{mode}/C{c}": count(local, prompts, params, c)
        for mode, params in modes.items()
        if mode in args.modes
        for c in args.concurrency
    }
    finish(result, args.out, "lookahead_misses", {"lookahead_misses.png": plot})


if __name__ == "__main__":
    main()
