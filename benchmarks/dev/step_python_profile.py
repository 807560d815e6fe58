"""Is a WeDLM step's extra time Python work, MLX's own host work, or waiting (issue 35)?
Prints one JSON object and writes step_python_profile.json to --out.

Part 1, cProfile: per prompt set (counting, chat), C (1, 8) and mode (AR; WeDLM W 16, tau
0.6; speculative with mask drafts, W 8, tau 1.5), the decode steps' median and mean ms
unprofiled, then one run under cProfile: the profiled step and the heaviest functions in
us per step, by self time and inclusive. cProfile slows Python code several-fold and
MLX's C++ not at all (a nanobind call's time is its Python caller's self time), so where
two modes' profiled steps cost alike while their plain steps differ, the difference is
not in Python.

Part 2, a host delay: the same runs with a busy wait of --delay-ms before every step,
interleaved with plain runs, rounds alternating. "absorbed" = plain + delay - delayed:
time that the host spent waiting (on the device, or on MLX's in-flight task limit) and
that a slower host hides.

  python benchmarks/dev/step_python_profile.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_io import finish, run_info
from benchmarks.dev.speculative import CHAT, COUNTING
from benchmarks.dev.step_profile import MODES as STEP_PROFILE_MODES
from coordinator.engine.local_engine import open_local_engine

now = time.perf_counter
# the three settings, as step_profile.py runs them
MODES = {m: STEP_PROFILE_MODES[m] for m in ("ar", "wedlm", "speculative")}


def decode_steps(
    engine, prompts, params, c: int, delay_s: float = 0.0, profile: cProfile.Profile | None = None
) -> list[float]:
    """Seconds per decode step (prefill steps left out; the delay not counted); `profile`
    records the decode steps only."""
    steps = []
    for start in range(0, len(prompts), c):
        seqs = [engine.submit(p, params) for p in prompts[start : start + c]]
        while any(not s.finished for s in seqs):
            decoding = all(s.decode_started is not None or s.finished for s in seqs)
            if delay_s:
                end = now() + delay_s
                while now() < end:  # busy: the core stays as it is under real host work
                    pass
            profiling = profile is not None and decoding
            if profiling:
                profile.enable()
            t0 = now()
            engine.step()
            dt = now() - t0
            if profiling:
                profile.disable()
            if decoding:
                steps.append(dt)
    return steps


def ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 3) if values else 0.0


def heaviest(stats: pstats.Stats, steps: int, top: int) -> dict:
    """us per step of the `top` heaviest functions, by self time and inclusive."""
    rows = [
        (f"{Path(file).name}:{line}({name})", tt, ct)
        for (file, line, name), (_, _, tt, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    per = 1e6 / max(steps, 1)
    by = lambda i: sorted(rows, key=lambda r: -r[i])[:top]  # noqa: E731
    return {
        "self_us": {r[0]: round(r[1] * per, 1) for r in by(1)},
        "inclusive_us": {r[0]: round(r[2] * per, 1) for r in by(2)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/wedlm-smollm2-135m-r2"))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--sets", nargs="+", default=["counting", "chat"], choices=["counting", "chat"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--plain-runs", type=int, default=3, help="unprofiled runs per cell")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--delay-ms", type=float, default=2.0, help="0: no part 2")
    ap.add_argument("--rounds", type=int, default=3, help="part 2's rounds")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()

    local = open_local_engine(args.model, num_rows=8)
    engine, tok = local.engine, local.tokenizer
    texts = {"counting": COUNTING, "chat": CHAT}
    sets = {
        name: [tok.encode(t, chat=name == "chat") for t in texts[name][: args.prompts]]
        for name in args.sets
    }
    modes = {m: replace(MODES[m], max_tokens=args.max_tokens) for m in args.modes}
    cells = [(s, c, m) for s in sets for c in args.concurrency for m in modes]
    for s, c, m in cells:  # every shape compiled before anything is timed
        decode_steps(engine, sets[s], modes[m], c)
    result = run_info(model=args.model, modes=args.modes, concurrency=args.concurrency)

    profiled: dict = {}
    for s, c, m in cells:
        plain = []
        for _ in range(args.plain_runs):
            plain += decode_steps(engine, sets[s], modes[m], c)
        profile = cProfile.Profile()
        steps = decode_steps(engine, sets[s], modes[m], c, profile=profile)
        key = f"{s}/C{c}/{m}"
        profiled[key] = {
            "plain_step_ms_median": ms(plain),
            "plain_step_ms_mean": round(1e3 * sum(plain) / max(len(plain), 1), 3),
            "profiled_step_ms_median": ms(steps),
        } | heaviest(pstats.Stats(profile), len(steps), args.top)
        print(
            key, {k: v for k, v in profiled[key].items() if not k.endswith("_us")}, file=sys.stderr
        )
    result["cprofile"] = profiled

    if args.delay_ms:
        delay = args.delay_ms / 1e3
        runs: dict = {}
        for r in range(args.rounds):
            for s, c, m in cells:
                order = (0.0, delay) if r % 2 == 0 else (delay, 0.0)
                for d in order:
                    steps = decode_steps(engine, sets[s], modes[m], c, d)
                    runs.setdefault(f"{s}/C{c}/{m}", {}).setdefault(d, []).append(ms(steps))
        result["host_delay"] = {
            key: {
                "plain_ms": round(statistics.median(by[0.0]), 3),
                "delayed_ms": round(statistics.median(by[delay]), 3),  # the delay not counted
                "absorbed_ms": round(statistics.median(by[0.0]) - statistics.median(by[delay]), 3),
                "rounds_plain": by[0.0],
                "rounds_delayed": by[delay],
            }
            for key, by in runs.items()
        }
        result["delay_ms"] = args.delay_ms
    finish(result, args.out, "step_python_profile")


if __name__ == "__main__":
    main()
