"""Measure the break-even of speculative drafts (step_cost.py) on this machine and model:
per row bucket, the wall time of a drafting forward (1 + k drafts + m mask slots rows per
sequence, read back before the next one is launched, as the engine must) against an AR
forward (one row per sequence, the next one launched before this one is read back: AR's
look-ahead). Each through the engine's pipeline, head, selection and sampling path, after
one untimed forward of each shape (its compile). Throw-away rows at KV length 0 that keep
nothing; released at the end.

`StepCostRun` measures one group of forwards per `step()`, so that the engine thread can
run it while it is idle, between requests (server.py): a request that arrives waits for one
forward group at most, never for the whole measurement."""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

import mlx.core as mx
import numpy as np

from common.generation_params import GenerationParams
from common.modes import Mode
from coordinator.engine.engine import Engine
from coordinator.engine.forward_shapes import row_bucket
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Sequence
from coordinator.engine.tick_batch import TickBatch, build_batch

log = logging.getLogger(__name__)

TIMING_IDS = (1 << 61) + (1 << 45)  # throw-away sequence ids (apart from warm-up's)
_batch_ids = itertools.count((1 << 41) + (1 << 36))  # apart from the engine's and warm-up's
_runs = itertools.count()  # each run's ids apart from an earlier run's (not yet released)
DRAFTS = 4  # a representative drafting forward: 4 drafts and 5 mask slots
PROGRESS_EVERY_S = 5.0  # a slow measurement says how far it is at least this often


class StepCostRun:
    """One measurement (module docstring), a group of forwards per `step()`.

    rows: the row buckets (default: every bucket up to the engine's max rows); medians of
    `rounds` interleaved rounds of `repeats` forwards each. budget_s: the buckets go
    smallest first, and the measurement stops once it has spent this many seconds of its
    own (time paused between steps does not count) with at least one round of the bucket
    in hand; the larger buckets then take the largest measured one's ratio
    (StepCost.break_even). A slow backend (MLX's CPU, through stages) would otherwise take
    minutes. `compile`: one untimed forward of each shape first (GPUs compile per shape;
    MLX's CPU backend does not). Each measured bucket seeds the engine's StepCost at once.
    Call `step` on the thread that owns MLX, while no forward is in flight."""

    def __init__(
        self,
        engine: Engine,
        rows: Iterable[int] | None = None,
        window: int = 8,
        repeats: int = 4,
        rounds: int = 3,
        budget_s: float | None = None,
        compile: bool = True,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        most = engine.shape_limits().max_rows
        self.buckets = sorted({row_bucket(r) for r in (rows or range(1, most + 1))})
        self.ratios: dict[int, float] = {}
        self.spent_s = 0.0  # seconds of forwards, paused time excluded
        self.cut_short = False  # stopped by the budget before the last bucket
        self.done = False
        self._say = progress or (lambda text: log.info("%s", text))
        self._said = 0.0
        self._forwards = 0
        self._used: list[int] = []
        self._steps = self._run(window, repeats, rounds, budget_s, compile)

    def step(self) -> bool:
        """Run the next group of forwards; False once the measurement is over."""
        if self.done:
            return False
        started = time.perf_counter()
        try:
            next(self._steps)
        except StopIteration:
            self.done = True
        finally:
            self.spent_s += time.perf_counter() - started
        if not self.done and self.spent_s - self._said >= PROGRESS_EVERY_S:
            self._said = self.spent_s
            self._say(
                f"still measuring the cost of a drafting forward: {self._forwards} forwards, "
                f"{len(self.ratios)} of {len(self.buckets)} row counts, {self.spent_s:.0f} s"
            )
        return not self.done

    def finish(self) -> dict[int, float]:
        """Run what is left, at once; returns the ratios."""
        while self.step():
            pass
        return self.ratios

    def close(self) -> None:
        """Stop here (a re-plan, a stop): the throw-away rows are released."""
        self._steps.close()
        self.done = True

    def _run(
        self, window: int, repeats: int, rounds: int, budget_s: float | None, compile: bool
    ) -> Iterator[None]:
        engine = self.engine
        assert not engine.in_flight, "measure while no forward is in flight"
        config = engine.config
        masks = 0 <= config.mask_token_id < config.vocab_size
        k = min(DRAFTS, window)
        base = TIMING_IDS + (next(_runs) << 20)
        try:
            for r in self.buckets:
                ids = [base + len(self._used) + i for i in range(r)]
                self._used += ids
                ar = _batch(ids, 0, 0)
                draft = _batch(ids, k, k + 1 if masks else 0)
                times: dict[str, list[float]] = {"ar": [], "draft": []}
                if compile:  # both shapes once, untimed
                    self._forward(ar, 1, ahead=True)
                    self._forward(draft, 1, ahead=False)
                    yield
                for _ in range(rounds):
                    times["ar"].append(self._forward(ar, repeats, ahead=True))
                    yield
                    times["draft"].append(self._forward(draft, repeats, ahead=False))
                    self.ratios[r] = statistics.median(times["draft"]) / statistics.median(
                        times["ar"]
                    )
                    engine.step_cost.seed({r: self.ratios[r]})
                    if budget_s is not None and self.spent_s > budget_s:
                        break
                    yield
                if budget_s is not None and self.spent_s > budget_s and r < self.buckets[-1]:
                    self.cut_short = True
                    return
        finally:
            if self._used:
                with contextlib.suppress(Exception):  # a pipeline lost meanwhile
                    engine.pipeline.release(self._used)
                self._used = []

    def _forward(self, batch: TickBatch, n: int, ahead: bool) -> float:
        self._forwards += n
        return _per_forward(self.engine, batch, n, ahead)

    def describe(self) -> str:
        return ", ".join(f"{r}: {v:.2f}" for r, v in self.ratios.items())


def measure_step_cost(
    engine: Engine,
    rows: Iterable[int] | None = None,
    window: int = 8,
    repeats: int = 4,
    rounds: int = 3,
    budget_s: float | None = None,
    compile: bool = True,
) -> dict[int, float]:
    """Drafting forward / AR forward per row bucket, measured at once (StepCostRun); seeds
    the engine's StepCost and returns the ratios."""
    run = StepCostRun(engine, rows, window, repeats, rounds, budget_s, compile)
    run.finish()
    log_measured(run)
    return run.ratios


def log_measured(run: StepCostRun) -> None:
    if run.cut_short:
        last = max(run.ratios) if run.ratios else 0
        log.info(
            "draft break-even measured up to %d rows in %.1f s (its budget): larger row "
            "counts take its ratio", last, run.spent_s,
        )  # fmt: skip
    log.info(
        "draft break-even (a drafting forward in AR forwards, by rows): %s, measured in %.2f s",
        run.describe(), run.spent_s,
    )  # fmt: skip


def _batch(ids: list[int], drafts: int, masks: int) -> TickBatch:
    """One row per id: the last committed token, `drafts` drafts and `masks` mask slots,
    with the logits of every row (as a speculative forward reads them)."""
    width = 1 + drafts + masks
    mode = Mode.SPECULATIVE if width > 1 else Mode.AR
    params = GenerationParams(mode=mode, window=max(drafts, 1), max_tokens=width + 1)
    plans = [
        RowPlan(
            seq=Sequence(sid, [0], params),
            tokens=np.zeros(width, np.int32),
            filled=np.arange(width) <= drafts,
            keep=0,
            head_slots=np.arange(width),
            head_is_mask=np.arange(width) > drafts,
            drafts=drafts,
        )
        for sid in ids
    ]
    return build_batch(plans)


def _per_forward(engine: Engine, batch: TickBatch, n: int, ahead: bool) -> float:
    """Seconds per forward over `n` forwards of `batch`, launched as the engine launches
    them: the next one before this one's read-back (`ahead`), or after it."""

    def launch() -> None:
        hidden = engine.parts.embed(mx.array(batch.tokens))
        engine.pipeline.submit(next(_batch_ids), batch.spec, hidden, batch.reply_slots())

    start = time.perf_counter()
    launch()
    for i in range(n):
        _, hidden = engine.pipeline.collect()
        out = engine._select(batch, hidden)[:2]
        mx.async_eval(*out)
        if ahead and i + 1 < n:
            launch()
        mx.eval(*out)
        if not ahead and i + 1 < n:
            launch()
    return (time.perf_counter() - start) / n
