"""What the engine does after a fault: continue on a new pipeline (a lost worker: every
live sequence rebuilds its KV from its tokens), requeue after running out of memory, or
fail everything. The causal engine's base (engine.py), beside its request intake."""

from __future__ import annotations

import contextlib
from collections import deque

import mlx.core as mx

from coordinator.engine.forward_clock import ForwardClock
from coordinator.engine.in_flight import InFlight
from coordinator.engine.padding_rows import PaddingRows
from coordinator.engine.pipeline import Pipeline
from coordinator.engine.scheduler import Commit, Scheduler
from coordinator.engine.sequence import Sequence


class EngineRecovery:
    pipeline: Pipeline
    scheduler: Scheduler
    in_flight: deque[InFlight]
    padding: PaddingRows
    clock: ForwardClock
    micro_batches: int
    undelivered: list[Commit]

    def restart_on(self, pipeline: Pipeline, micro_batches: int | None = None) -> None:
        """Continue on a new pipeline after losing a worker: forwards in flight are gone,
        so every live sequence re-prefills its committed history, then decodes on."""
        stale = self.scheduler.row_ids() + self.padding.take_all()
        stale += self.scheduler.drop_cache()  # rebuilt by use, never trusted stale
        pipeline.release(stale)  # surviving workers may still hold rows of these
        self.in_flight.clear()
        self.clock.compiling.clear()
        self.pipeline = pipeline
        if micro_batches:
            self.micro_batches = micro_batches
        self.scheduler.restart(self.micro_batches)

    def requeue_for_memory(self) -> list[Sequence]:
        """After a forward ran out of memory: the forwards in flight are dropped (what the
        stages still answer is read and discarded, so the pipeline is empty, not re-planned),
        every stage forgets the running sequences' rows and the prefix cache, MLX's free
        buffers go back to the system, and the running sequences wait in the queue again
        to rebuild their KV from their tokens. Returns the sequences requeued."""
        for _ in range(len(self.in_flight)):
            with contextlib.suppress(Exception):  # a forward that failed too: nothing kept
                self.pipeline.collect()
        self.in_flight.clear()
        stale = self.scheduler.row_ids() + self.padding.take_all()
        stale += self.scheduler.drop_cache()
        self.pipeline.release(stale)
        mx.synchronize()  # nothing may be recording when the buffers are freed (CUDA)
        mx.clear_cache()
        return self.scheduler.requeue_running()

    def fail_all(self) -> list[Sequence]:
        """Finish every running sequence with an error (a forward was lost)."""
        self.in_flight.clear()
        self.padding.take_all()
        self.scheduler.drop_cache()
        return self.scheduler.fail_all()

    def take_undelivered(self) -> list[Commit]:
        commits, self.undelivered = self.undelivered, []
        return commits
