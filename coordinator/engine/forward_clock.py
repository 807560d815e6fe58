"""The wall time of decode forwards, fed to step_cost (the drafts' break-even): the time
between two read-backs, taken only where it prices one kind of forward (one micro-batch at
a time, no prompt chunk, no shape compiling for the first time)."""

from __future__ import annotations

import time

from coordinator.engine.in_flight import InFlight
from coordinator.engine.modes import mode_of
from coordinator.engine.scheduler import PREFILL
from coordinator.engine.sequence import Phase
from coordinator.engine.step_cost import AR, DRAFT, StepCost


class ForwardClock:
    def __init__(self) -> None:
        self.last_done = 0.0  # when the last forward was read back
        self.compiling: set[int] = set()  # forwards of a shape new to this engine

    def observe(self, step_cost: StepCost, flight: InFlight, micro_batches: int) -> None:
        """All one-row rows launched ahead give AR's cost; rows with drafts or mask slots a
        drafting forward's."""
        done, last = time.perf_counter(), self.last_done
        self.last_done = done
        compiling = flight.batch_id in self.compiling
        self.compiling.discard(flight.batch_id)
        if micro_batches != 1 or flight.unit is PREFILL or compiling:
            return
        plans = flight.plans
        if any(
            p.seq.phase is not Phase.DECODE or not mode_of(p.seq.params.mode).times_steps
            for p in plans
        ):
            return
        if all(p.width == 1 for p in plans):
            if flight.started < last:  # launched ahead of the last one's read-back
                step_cost.observe(AR, len(plans), done - last)
        elif any(p.width > p.keep for p in plans):  # drafts or mask slots, as they run:
            # launched ahead (a probe, a chained spell) or after the last read-back. Either
            # way its cost is the time between read-backs, as AR's is: one launched after
            # the read-back also makes the device wait for the host's postprocess and
            # planning in between, which AR's look-ahead hides (its launch alone priced
            # 4-row drafts at 1.0 AR forwards on an H100, RESULTS.md SC9).
            step_cost.observe(DRAFT, len(plans), done - last)
