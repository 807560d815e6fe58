"""The engine's look-ahead forwards: a unit's next forward launched from this step's device
results before they are read back, where a row's mode can build it (modes/*.py
launch_ahead; this is the AheadRoom they are lent), then named once the step is
postprocessed (`resolve`), or dropped when a grammar cut the run it was built from."""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

import mlx.core as mx
import numpy as np

from common.model_parts import ModelParts
from common.rows_spec import RowsSpec
from coordinator.engine import modes
from coordinator.engine.grammar_fills import GrammarFills
from coordinator.engine.in_flight import InFlight
from coordinator.engine.modes import PlanContext
from coordinator.engine.pipeline import Pipeline
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.scheduler import PREFILL, Commit, Scheduler, Unit
from coordinator.engine.sequence import Sequence
from coordinator.engine.step_cost import StepCost
from coordinator.engine.tick_batch import build_batch


class AheadOwner(Protocol):
    """The engine, as its look-ahead uses it."""

    parts: ModelParts
    pipeline: Pipeline
    scheduler: Scheduler
    in_flight: deque[InFlight]
    micro_batches: int
    fills: GrammarFills
    constrained_ahead: bool
    speculative_ahead: bool
    ahead_dropped: int
    speculative_chained: int

    @property
    def step_cost(self) -> StepCost: ...
    def _plan_context(self, rows: int) -> PlanContext: ...
    def _padding_ids(self, unit: Unit, rows: int) -> list[int]: ...
    def _submit(self, spec: RowsSpec, hidden: mx.array, reply: np.ndarray | None) -> int: ...


class LookAhead:
    def __init__(self, owner: AheadOwner) -> None:
        self.owner = owner
        self.ctx = PlanContext(0, 0)
        # modes whose look-ahead is off (benchmarks and tests compare with the serial path)
        self.off: set[str] = set()

    def launch(self, flight: InFlight, fills: mx.array, tokens: mx.array) -> bool:
        """Launch the first look-ahead forward a row's mode builds for `flight`'s unit."""
        started = time.perf_counter()
        owner = self.owner
        self.ctx = owner._plan_context(len(flight.plans))
        ahead = modes.launch_ahead(self, flight, fills, tokens)
        if ahead is None:
            return False
        reply = ahead.batch.reply_slots() if ahead.batch is not None else None
        batch_id = owner._submit(ahead.spec, owner.parts.embed(ahead.ids), reply)
        unresolved = ahead.batch is None  # step t's plans stand in until resolve
        owner.in_flight.append(
            InFlight(batch_id, flight.unit, ahead.plans, ahead.batch, started, unresolved,
                     width=ahead.width, caps=ahead.caps)
        )  # fmt: skip
        owner.speculative_chained += ahead.caps is not None
        return True

    def drop(self, flight: InFlight) -> None:
        """The grammar cut a window's leading run (constrained.advance) that the look-ahead
        forward was built from uncut: its inputs are not the window's. Nothing of it becomes
        permanent; the engine reads it back, discards it, and launches the unit again."""
        self.owner.pipeline.keep([p.seq.seq_id for p in flight.plans], [0] * len(flight.plans))
        flight.dropped = True
        self.owner.ahead_dropped += 1

    def resolve(self, flight: InFlight, commits: list[Commit]) -> None:
        """Step t is read back and postprocessed: the look-ahead forward's rows are now
        known. Its plans are the ones its mode makes now (a sequence whose committing
        tokens end it finishes without them), its kept rows are named to the pipeline,
        and selection will read the head slots of each plan."""
        ctx = self.owner._plan_context(len(flight.plans))
        plans, keeps = [], []
        for i, stand_in in enumerate(flight.plans):
            seq, plan = stand_in.seq, None
            if not seq.finished:
                plan = modes.mode_of(seq.params.mode).resolve_ahead(stand_in, flight, i, ctx)
                plan = plan or self.owner.scheduler.plan_or_finish(seq, commits)
            if plan is None:  # its row runs anyway; nothing of it is kept or read
                plan = RowPlan(seq, stand_in.tokens[:1], stand_in.filled[:1], 0, _NONE, _NO)
            plans.append(plan)
            keeps.append(plan.keep)
        self.owner.pipeline.keep([p.seq.seq_id for p in plans], keeps)
        flight.plans = plans
        flight.batch = build_batch(plans)

    # ---- what a mode asks (modes.base.AheadRoom) -----------------------------------------
    @property
    def step_cost(self) -> StepCost:
        return self.owner.step_cost

    def allows(self, mode: str) -> bool:
        return mode not in self.off

    @property
    def keeps_later(self) -> bool:
        """Every layer runs in this process: a forward's kept rows may be named later."""
        return getattr(self.owner.pipeline, "keeps_later", False)

    @property
    def constrained_ahead(self) -> bool:
        return self.owner.constrained_ahead

    @property
    def speculative_ahead(self) -> bool:
        return self.owner.speculative_ahead

    @property
    def cut(self) -> set[int]:
        return self.owner.fills.cut

    def prefill(self, flight: InFlight) -> bool:
        return flight.unit is PREFILL

    def joiners(self, flight: InFlight, plans: list[RowPlan]) -> list[Sequence] | None:
        return self.owner.scheduler.joiners(flight.unit, plans)

    def slot_owed(self, flight: InFlight) -> bool:
        """Whether the next free slot is owed to a prefill or another group (no starving)."""
        owed = len(self.owner.in_flight) + 1 >= self.owner.micro_batches
        return owed and self.owner.scheduler.other_work(flight.unit)

    def chain_breaks(self, flight: InFlight, plans: list[RowPlan]) -> bool:
        """Whether a look-ahead built on the device must wait for the regular launch:
        arrivals or departures (it takes everyone), or a slot owed elsewhere."""
        return self.joiners(flight, plans) != [] or self.slot_owed(flight)

    def padding_ids(self, flight: InFlight, rows: int) -> list[int]:
        return self.owner._padding_ids(flight.unit, rows)


_NONE = np.zeros(0, dtype=np.int64)
_NO = np.zeros(0, dtype=bool)
