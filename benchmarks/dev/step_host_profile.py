"""Where the host's time goes in each kind of decode step (issue 35): py-spy, with native
frames, samples the engine's thread while it decodes in one mode, then the next.

On MLX-CUDA a 135M model's step is bound by the host (RESULTS.md SC1, SC6), and a bare
forward of 8-32 rows, launched ahead, costs what a one-row forward costs
(`forward_width.py`), so what a WeDLM or speculative step costs beyond AR's is host work
around the forward. Per mode (AR, WeDLM W 16, speculative with mask drafts W 8 at a fixed
break-even), a child process decodes the counting prompts over and over; once it has
compiled its shapes, py-spy records it for --seconds. Reported per mode: forwards per
second while sampled, and ms per forward of the heaviest frames (inclusive and self),
Python and native (MLX's C++, CUDA's driver).

Needs py-spy (`pip install py-spy`) and the right to attach to a child (root, or
ptrace_scope 0; on macOS, sudo).

  python benchmarks/dev/step_host_profile.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev.bench_io import finish, run_info
from benchmarks.dev.profile_serving import parse_raw, summarize
from benchmarks.dev.speculative import WEDLM_MODEL

MODES = ("ar", "wedlm", "speculative")


def child(model: str, mode: str, seconds: float, break_even: float) -> None:
    """Decode until `seconds` after the ready line; then print forwards and time."""
    from benchmarks.dev.speculative import COUNTING
    from common.generation_params import GenerationParams
    from coordinator.engine.local_engine import open_local_engine

    local = open_local_engine(model, num_rows=8)
    engine = local.engine
    engine.step_cost.seed({b: break_even for b in (1, 2, 4, 8)})
    engine.step_cost.online = False
    params = {
        "ar": GenerationParams(mode="ar", max_tokens=64),
        "wedlm": GenerationParams(mode="wedlm", window=16, threshold=0.6, max_tokens=64),
        "speculative": GenerationParams(
            mode="speculative", draft="mask", window=8, threshold=1.5, max_tokens=64
        ),
    }[mode]
    prompts = [local.tokenizer.encode(t) for t in COUNTING[:4]]

    def one(prompt) -> tuple[int, int]:
        seq = engine.submit(prompt, params)
        for _ in engine.stream([seq]):
            pass
        return seq.forwards, len(seq.output)

    for prompt in prompts:  # every shape compiled before the profile
        one(prompt)
    print("ready", flush=True)
    start = time.perf_counter()
    forwards = tokens = 0
    while time.perf_counter() - start < seconds:
        for prompt in prompts:
            f, t = one(prompt)
            forwards, tokens = forwards + f, tokens + t
    print(json.dumps({"forwards": forwards, "tokens": tokens,
                      "seconds": time.perf_counter() - start}), flush=True)  # fmt: skip


def frame_name(frame: str) -> str:
    """py-spy's `name (file:line)` without the line: one entry per function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def profile_mode(args, py_spy: str, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--model", str(args.model),
           "--seconds", str(args.seconds + 2), "--break-even", str(args.break_even)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while (line := proc.stdout.readline()) and line.strip() != "ready":
        pass
    raw = args.out / f"{mode}.raw.txt"
    spy = subprocess.run(
        [py_spy, "record", "--pid", str(proc.pid), "--duration", str(int(args.seconds)),
         "--rate", str(args.rate), "--format", "raw", "--native",
         "--output", str(raw)],
        capture_output=True, text=True,
    )  # fmt: skip
    done = json.loads(proc.stdout.readline() or "{}")
    proc.wait()
    if spy.returncode != 0 or not raw.exists():
        return {"error": spy.stderr[-2000:]}
    if not done.get("forwards"):
        return {"error": f"the child ended (rc {proc.returncode}) before reporting its forwards"}
    # one entry per function, not per line
    stacks = [(t, [frame_name(f) for f in frames], n) for t, frames, n in parse_raw(raw)]
    shares = summarize(stacks, args.top)
    per_s = done["forwards"] / done["seconds"]
    # a sample stands for 1 / rate s of the (non-idle) thread; forwards in the window
    sampled_ms = 1e3 * shares["samples"] / args.rate / (per_s * args.seconds)

    def ms(ranked: list[tuple[str, float]]) -> list[tuple[str, float]]:
        return [(name, round(share * sampled_ms, 3)) for name, share in ranked]

    return {
        "forwards_per_s": round(per_s, 1),
        "tokens_per_forward": round(done["tokens"] / done["forwards"], 3),
        "ms_per_forward": round(1e3 / per_s, 3),
        "sampled_ms_per_forward": round(sampled_ms, 3),
        "samples": shares["samples"],
        "inclusive_ms": ms(shares["inclusive"]),
        "self_ms": ms(shares["self"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=WEDLM_MODEL)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--break-even", type=float, default=1.5)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/step_host_profile"))
    args = ap.parse_args()
    if args.child:
        child(str(args.model), args.child, args.seconds, args.break_even)
        return
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_info(model=str(args.model), seconds=args.seconds, rate=args.rate,
                      break_even=args.break_even)  # fmt: skip
    for mode in args.modes:
        result[mode] = profile_mode(args, py_spy, mode)
        print(
            f"{mode}: {result[mode].get('ms_per_forward')} ms per forward",
            file=sys.stderr,
            flush=True,
        )
    finish(result, args.out, "step_host_profile")


if __name__ == "__main__":
    main()
