"""Where one decode step's time goes, per mode (issue 35). Prints one JSON object and writes
step_profile.json and step_profile.png to --out.

Part 1, the engine: greedy requests (counting prompts, C = 1 and C = 8) in AR, WeDLM (W 16,
tau 0.6) and speculative mode with mask drafts (W 8, tau 1.5), and two WeDLM variants in the
same process: without its look-ahead (wedlm_serial) and with the step's selection and masks
built eagerly instead of compiled (wedlm_eager); and each mode on the layers' own q/k/v and
gate/up matmuls instead of the fused ones (ar_unfused, wedlm_unfused, speculative_unfused:
common/fused_projections.py), swapped in within the same process; the engine's own methods are
wrapped with timers, so each step's wall time splits into
  plan    scheduler.next_micro_batch (row plans, finishing checks)
  batch   build_batch (padding the plans into arrays)
  graph   embed + pipeline.submit (the host building the layers' lazy graph; on CUDA this
          includes recording the kernels)
  select  the head + selection + sampling graph (_select)
  wait    mx.eval in _complete: the host waiting for the device (the one sync)
  post    scheduler.postprocess (commits, stop checks, window updates)
  reap    scheduler.reap and the rest of step()
Inclusive times of nested calls are charged to the innermost name only.

Speculative runs also report the fraction of decode micro-batches that drafted and the
draft break-even in use (refined online from the engine's forwards). Every run splits its
steps by the widths of the forwards they launched (by_launched_width: count, median ms).

Part 2, bare forwards at the same context: T = 1, and a WeDLM window of T rows with the
explicit (non-causal) mask and with a causal mask, each (a) serial: build + eval, and (b) the
host's graph build alone (no eval), so device ~= serial - build where they do not overlap;
with an _unfused mode asked for, on the unfused layers too (bare_forwards_unfused).

  python benchmarks/dev/step_profile.py --model ../shared/models/wedlm-smollm2-135m-r2 --out OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import common.kv_rows as kv_rows
import common.window_mask as window_mask
import coordinator.engine.engine as engine_module
import coordinator.engine.head_choice as head_choice
import coordinator.engine.modes.wedlm as wedlm_mode
import coordinator.engine.selection as selection
from benchmarks.dev.bench_io import build_then_wait, finish, pyplot, run_info
from benchmarks.dev.engine import swapped, wedlm_filled, window_forward
from benchmarks.dev.speculative import COUNTING
from common.generation_params import GenerationParams
from common.kv_rows import KVRows
from common.model_parts import ModelParts, load_model_parts
from common.modes import Mode
from common.window_mask import window_visibility
from coordinator.engine.local_engine import open_local_engine

now = time.perf_counter
MODES = {
    "ar": GenerationParams(mode="ar", max_tokens=64),
    "wedlm": GenerationParams(mode="wedlm", window=16, threshold=0.6, max_tokens=64),
    # WeDLM without the look-ahead (wedlm_ahead.py): every step reads back before the next
    "wedlm_serial": GenerationParams(mode="wedlm", window=16, threshold=0.6, max_tokens=64),
    # WeDLM with the step's selection and masks built eagerly, not compiled (selection.py)
    "wedlm_eager": GenerationParams(mode="wedlm", window=16, threshold=0.6, max_tokens=64),
    "speculative": GenerationParams(
        mode="speculative", draft="mask", window=8, threshold=1.5, max_tokens=64
    ),
}
# the same modes on the layers' own projections (q/k/v and gate/up unfused)
MODES |= {f"{m}_unfused": MODES[m] for m in ("ar", "wedlm", "speculative")}


class Timers:
    """Exclusive time per name: a nested timed call's time is not charged to its caller."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []
        self.launched: list[int] = []  # the widths of the forwards this step launched

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            frame = [name, 0.0]
            self.stack.append(frame)
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = now() - start
                self.stack.pop()
                self.total[name] += spent - frame[1]
                if self.stack:
                    self.stack[-1][1] += spent

        return timed


class _TimedMx:
    """mlx.core for engine.py, with eval timed as "wait"."""

    def __init__(self, timers: Timers) -> None:
        self._eval = timers.wrap("wait", mx.eval)

    def __getattr__(self, name):
        return self._eval if name == "eval" else getattr(mx, name)


def instrument(engine, timers: Timers) -> None:
    s = engine.scheduler
    s.next_micro_batch = timers.wrap("plan", s.next_micro_batch)
    s.postprocess = timers.wrap("post", s.postprocess)
    s.reap = timers.wrap("reap", s.reap)
    engine.parts.embed = timers.wrap("graph", engine.parts.embed)
    submit = timers.wrap("graph", engine.pipeline.submit)

    def launched(batch_id, spec, hidden, *rest):
        timers.launched.append(int(hidden.shape[1]))
        return submit(batch_id, spec, hidden, *rest)

    engine.pipeline.submit = launched
    engine._select = timers.wrap("select", engine._select)
    engine_module.build_batch = timers.wrap("batch", engine_module.build_batch)
    engine_module.mx = _TimedMx(timers)


@contextmanager
def eager_extras(on: bool):
    """The engine's compiled step graphs (selection, the look-ahead's visibility, the
    attention mask) swapped for their eager originals while `on`: an A/B in one process."""
    swaps = [
        (head_choice, "window_fills", selection.eager_window_fills),
        (wedlm_mode, "compiled_device_visibility", window_mask.device_visibility),
        (kv_rows, "compiled_attention_mask", window_mask.attention_mask),
    ]
    saved = [getattr(module, name) for module, name, _ in swaps]
    if on:
        for module, name, eager in swaps:
            setattr(module, name, eager)
    try:
        yield
    finally:
        for (module, name, _), old in zip(swaps, saved, strict=True):
            setattr(module, name, old)


@contextmanager
def unfused_layers(parts: ModelParts, unfused: list[nn.Module] | None):
    """`parts`' layers run with `unfused`'s attention and MLP modules (the same weights,
    loaded with fuse=False) while the block lasts; None leaves them as they are."""
    if unfused is None:
        yield
        return
    names = ("self_attn", "mlp")
    with swapped(parts.layers, names, [{n: ref[n] for n in names} for ref in unfused]):
        yield


@contextmanager
def variant(mode: str, parts, unfused: list[nn.Module] | None):
    eager = eager_extras(mode.endswith("_eager"))
    with eager, unfused_layers(parts, unfused if mode.endswith("_unfused") else None):
        yield


def run_mode(
    local, prompts, params: GenerationParams, concurrency: int, timers: Timers, serial=False
) -> dict:
    engine = local.engine
    if serial:
        engine.ahead.off.add(Mode.WEDLM)
    steps: list[float] = []
    by_width: dict[str, list[float]] = defaultdict(list)
    tokens = forwards = 0
    timers.total.clear()
    forwards_before = engine.forwards
    batches_before = engine.speculative_batches, engine.drafting_batches
    for start in range(0, len(prompts), concurrency):
        seqs = [engine.submit(p, params) for p in prompts[start : start + concurrency]]
        # the prefill steps are excluded: time the decode steps only
        while any(not s.finished for s in seqs):
            decoding = all(s.decode_started is not None or s.finished for s in seqs)
            snapshot = dict(timers.total)
            timers.launched.clear()
            t0 = now()
            engine.step()
            dt = now() - t0
            if decoding:
                steps.append(dt)
                by_width[",".join(map(str, timers.launched)) or "none"].append(dt)
            else:  # undo this step's timers
                timers.total.clear()
                timers.total.update(snapshot)
        tokens += sum(len(s.output) for s in seqs)
        forwards += sum(s.forwards for s in seqs)
    if serial:
        engine.ahead.off.discard(Mode.WEDLM)
    n = len(steps)
    if not n:
        return {"steps": 0, "step_ms_median": float("inf"), "decode_tok_s": 0.0}
    split = {k: round(1e3 * v / n, 3) for k, v in sorted(timers.total.items())}
    split["other"] = round(1e3 * sum(steps) / n - sum(split.values()), 3)
    return {
        "steps": n,
        "engine_forwards": engine.forwards - forwards_before,
        "step_ms_median": round(1e3 * statistics.median(steps), 3),
        "step_ms_mean": round(1e3 * sum(steps) / n, 3),
        "tokens_per_forward": round(tokens / forwards, 3) if forwards else None,
        "decode_tok_s": round(tokens / sum(steps), 1),
        "split_ms_per_step": split,
        # steps by the widths of the forwards they launched: count, median ms
        "by_launched_width": {
            k: [len(v), round(1e3 * statistics.median(v), 3)]
            for k, v in sorted(by_width.items(), key=lambda kv: -len(kv[1]))
        },
    } | _draft_stats(engine, batches_before, params)


def _draft_stats(engine, before: tuple[int, int], params: GenerationParams) -> dict:
    """Speculative mode: of the decode micro-batches, the fraction that drafted (the batch
    decides: draft_policy.py), and the break-even in use (step_cost.py, refined online)."""
    if params.mode != "speculative":
        return {}
    batches = engine.speculative_batches - before[0]
    drafting = engine.drafting_batches - before[1]
    return {
        "drafting_batch_fraction": round(drafting / batches, 3) if batches else None,
        "break_even": {str(r): v for r, v in engine.step_cost.describe().items()},
    }


def bare_forwards(parts, context: int, widths: list[int], repeats: int) -> dict:
    """Serial (build + eval) and build-only ms per forward at `context` committed rows."""
    kv = KVRows(len(parts.layers), 1)
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(0, parts.config.vocab_size, (1, n)).astype(np.int32)  # noqa: E731
    mx.eval(window_forward(parts, kv, ids(context), np.tri(context, dtype=bool)[None]))
    kv.commit([context])
    out: dict = {}
    for t in widths:
        kinds = {"causal": np.tri(t, dtype=bool)[None]}
        if t > 1:
            kinds["wedlm"] = window_visibility(wedlm_filled(t))[None]
        heads = np.arange(t)[None] if t > 1 else None
        for kind, windows in kinds.items():

            def forward(t=t, windows=windows, heads=heads) -> mx.array:
                return window_forward(parts, kv, ids(t), windows, heads)

            build, wait = build_then_wait(forward, repeats)
            serial = [b + w for b, w in zip(build, wait, strict=True)]
            out[f"{kind}/T{t}"] = {
                "serial_ms": round(1e3 * statistics.median(serial), 3),
                "build_ms": round(1e3 * statistics.median(build), 3),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/wedlm-smollm2-135m-r2"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the modes")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bare-repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()

    for name, params in MODES.items():
        MODES[name] = replace(params, max_tokens=args.max_tokens)
    local = open_local_engine(args.model, num_rows=8)
    parts = local.engine.parts
    unfused = None
    if any(m.endswith("_unfused") for m in args.modes):
        unfused = list(load_model_parts(args.model, fuse=False).layers)
    prompts = [local.tokenizer.encode(t) for t in COUNTING[: args.prompts]]
    timers = Timers()
    instrument(local.engine, timers)
    result = run_info(model=args.model, concurrency=args.concurrency, modes=args.modes)
    for name in args.modes:  # warm-up: every mode's shapes once
        params = MODES[name]
        with variant(name, parts, unfused):
            run_mode(local, prompts[:8], params, 8, timers, name.endswith("_serial"))
            run_mode(local, prompts[:1], params, 1, timers, name.endswith("_serial"))
    rounds: dict[str, list[dict]] = defaultdict(list)
    for _ in range(args.repeats):
        for c in args.concurrency:
            for mode in args.modes:
                serial = mode.endswith("_serial")
                with variant(mode, parts, unfused):
                    run = run_mode(local, prompts, MODES[mode], c, timers, serial)
                rounds[f"{mode}/C{c}"].append(run)
                print(f"{mode}/C{c}: {rounds[f'{mode}/C{c}'][-1]}", file=sys.stderr, flush=True)
    engine_out = {}
    for key, runs in rounds.items():
        best = min(runs, key=lambda r: r["step_ms_median"])
        engine_out[key] = best | {"step_ms_medians": [r["step_ms_median"] for r in runs]}
    for c in args.concurrency:
        for mode in MODES:
            ar = engine_out.get(f"ar_unfused/C{c}" if mode.endswith("_unfused") else f"ar/C{c}")
            other = engine_out.get(f"{mode}/C{c}")
            if mode.startswith("ar") or other is None:
                continue
            if ar and other:
                other["step_vs_ar"] = round(other["step_ms_median"] / ar["step_ms_median"], 3)
                other["tok_s_vs_ar"] = round(other["decode_tok_s"] / ar["decode_tok_s"], 3)
    result["engine"] = engine_out
    widths = [1, 8, 16, 24, 32]
    result["bare_forwards"] = bare_forwards(parts, 64, widths, args.bare_repeats)
    if unfused is not None:
        with unfused_layers(parts, unfused):
            result["bare_forwards_unfused"] = bare_forwards(parts, 64, widths, args.bare_repeats)
    finish(result, args.out, "step_profile", {"step_profile.png": plot})


def plot(result: dict, path: Path) -> None:
    """One stacked bar per mode and C: the step's median split by where the host spends it."""
    plt = pyplot()
    keys = list(result["engine"])
    parts = ["plan", "batch", "graph", "select", "wait", "post", "reap", "other"]
    fig, ax = plt.subplots(figsize=(1.1 * len(keys) + 3, 4.5))
    bottom = np.zeros(len(keys))
    for part in parts:
        # a run with no decode step (every request done in its opening) has no split
        split = [result["engine"][k].get("split_ms_per_step", {}) for k in keys]
        vals = np.array([max(one.get(part, 0), 0) for one in split])
        ax.bar(keys, vals, bottom=bottom, label=part)
        bottom += vals
    ax.set_ylabel("ms per decode step (mean)")
    ax.set_title(f"{result['model']} on {result['device']}")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
