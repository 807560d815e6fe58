"""The step cost a start needs, and no more before readiness: the draft break-even of
speculative requests (step_timing.py) and, for a WeDLM-trained checkpoint, what mode
"auto" decodes with (auto_mode.py).

- A figure measured before on this machine for this model and pipeline (measured_costs.py)
  is reused: nothing is measured.
- Mode auto's choice needs one figure before the first request (a 10-row forward against a
  one-row one): measured before readiness only for a WeDLM-trained checkpoint (on any
  other, auto is AR whatever it costs), in a few forwards, said in plain words.
- The break-even of every row bucket is needed only by speculative requests: it is
  measured after readiness, on the engine thread, a group of forwards at a time while the
  engine has been idle for IDLE_BEFORE_S (a request waits for one group at most), then
  kept for the next start. Until then the break-even is what was measured so far."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx

from common.modes import Mode
from coordinator.engine.auto_mode import auto_mode
from coordinator.engine.engine import Engine
from coordinator.engine.measured_costs import CostKey, MeasuredCosts
from coordinator.engine.step_timing import StepCostRun, log_measured
from coordinator.engine.warmup import WarmUpRun

log = logging.getLogger(__name__)
# On MLX's CPU backend through 2 stages every row bucket of a 32-row decode group took
# over 10 minutes on 2 shared cores: past this many seconds of forwards, the larger row
# buckets take the largest measured one's ratio.
PRICE_BUDGET_S = 20.0
IDLE_BEFORE_S = 3.0  # the engine idle this long before a background measurement step


class StartupCosts:
    """Owns the measurement of one server's step costs (module docstring).

    key: the cost key of the current pipeline (called again after a re-plan); rows: the
    row buckets a background measurement covers (called likewise; [] measures none: the
    engine refines its one micro-batch's figures online). store None: nothing is kept."""

    def __init__(
        self,
        engine: Engine,
        key: Callable[[], CostKey],
        rows: Callable[[], list[int]],
        store: MeasuredCosts | None,
    ) -> None:
        self.engine = engine
        self._key, self._rows, self.store = key, rows, store
        self.slow = mx.default_device() == mx.cpu  # no compile per shape; slow wide forwards
        self.auto_reason = ""  # why auto does not decode with the checkpoint's own mode
        self._pending: list[int] = []  # row buckets left to measure in the background
        self._run: StepCostRun | None = None
        self._warm: WarmUpRun | None = None  # the warm-up's shapes left for idle time
        self._seen_forwards = -1
        self._idle_since = time.monotonic()

    # ---- before readiness (the planner thread) ---------------------------------------
    def prepare(self) -> None:
        """Reuse what was measured before, or measure what auto needs now; leave the rest
        for the engine's idle time."""
        key, engine = self._key(), self.engine
        self._pending = self._rows()
        known = self.store.load(key) if self.store is not None else None
        if known is not None:
            engine.step_cost.seed(known["ratios"])
            ago = _ago(time.time() - known.get("measured_at", time.time()))
            log.info(
                "step cost: reusing what this machine measured for this model %s (%s)",
                ago, self.store.path,
            )  # fmt: skip
            self._pending = []
            self._choose_auto(known["ratios"].get(1))
            return
        if engine.config.default_mode == Mode.WEDLM:
            log.info(
                "measuring what a forward of several rows costs against a one-row one, to "
                "choose how mode auto decodes this WeDLM checkpoint (a few forwards)"
            )
            probe = self._measurement([1], repeats=2, rounds=1)
            probe.finish()
            self._choose_auto(probe.ratios.get(1))
            if self._pending == [1] or not self._pending:
                self._keep(probe)
                self._pending = []
        if self._pending:
            log.info(
                "the draft break-even of speculative requests is measured in the background "
                "once the server is idle (kept for the next start)"
            )

    def _choose_auto(self, wide_cost: float | None) -> None:
        mode, self.auto_reason = auto_mode(self.engine.config.default_mode, wide_cost)
        self.engine.use_auto_mode(mode if self.auto_reason else None)
        if self.auto_reason:
            log.warning("%s", self.auto_reason)

    def warm_in_background(self, run: WarmUpRun) -> None:
        """Compile these shapes while idle, before any background measurement (which
        runs some of them)."""
        self._warm = run if not run.done else None

    # ---- on the engine thread ----------------------------------------------------------
    def due(self) -> bool:
        """A background step should run now (the engine idle long enough)."""
        if not self._pending and self._run is None and self._warm is None:
            return False
        now = time.monotonic()
        if self.engine.forwards != self._seen_forwards or self.engine.has_work:
            self._seen_forwards, self._idle_since = self.engine.forwards, now
            return False
        return now - self._idle_since >= IDLE_BEFORE_S

    def step(self) -> None:
        """One forward of the background warm-up, else one group of forwards of the
        background measurement (call while idle)."""
        if self._warm is not None:
            self._warm_step(self._warm)
            self._seen_forwards = self.engine.forwards
            return
        try:
            if self._run is None:
                log.info("idle: measuring the draft break-even of speculative requests")
                self._run = self._measurement(self._pending, budget_s=PRICE_BUDGET_S)
            if not self._run.step():
                self._keep(self._run)
                self._run, self._pending = None, []
        except Exception as e:  # a stage lost meanwhile: serving finds it and re-plans
            log.warning("the draft break-even's measurement stopped: %s", e)
            self.close()
            self._pending = []
        self._seen_forwards = self.engine.forwards

    def _warm_step(self, warm: WarmUpRun) -> None:
        if not warm.warmer.forwards:
            log.info(
                "idle: compiling the shapes of larger batches in the background "
                "(row counts %s; a request waits for one forward at most)",
                ", ".join(map(str, warm.buckets)),
            )
        try:
            more = warm.step()
        except Exception as e:  # a stage lost meanwhile: serving finds it and re-plans
            log.warning("the background warm-up stopped: %s", e)
            warm.drop()
            more = False
        if not more:
            self._warm = None
            log.info(
                "background warm-up: %d forwards, %d shapes (%d new) in %.1f s",
                warm.warmer.forwards, len(warm.warmer.keys), warm.warmer.new, warm.seconds,
            )  # fmt: skip

    def replanned(self) -> None:
        """After a re-plan (engine thread): the old pipeline's figures may not hold, and
        its shapes are compiled as requests come (no warm-up holds them)."""
        if self._warm is not None:
            self._warm.drop()
            self._warm = None
        if self._run is not None:
            self._run.close()
            self._run = None
        key = self._key()
        known = self.store.load(key) if self.store is not None else None
        if known is not None:
            self.engine.step_cost.seed(known["ratios"])
            self._pending = []
        else:
            self._pending = self._rows()

    def close(self) -> None:
        if self._warm is not None:
            self._warm.close()
            self._warm = None
        if self._run is not None:
            self._run.close()
            self._run = None

    def _measurement(
        self, rows: list[int], repeats: int = 4, rounds: int = 3, budget_s: float | None = None
    ) -> StepCostRun:
        if self.slow:  # a drafting forward takes seconds there: one per step
            repeats = 1
        return StepCostRun(
            self.engine, rows, repeats=repeats, rounds=rounds, budget_s=budget_s,
            compile=not self.slow,
        )  # fmt: skip

    def _keep(self, run: StepCostRun) -> None:
        if self.store is not None and run.ratios:
            self.store.save(self._key(), run.ratios, run.spent_s)
        log_measured(run)


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"
