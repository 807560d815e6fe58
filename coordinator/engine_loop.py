"""The thread that owns MLX in the coordinator: it takes new jobs and cancellations from a
queue, ticks the engine, and publishes each tick's commits to the jobs."""

from __future__ import annotations

import logging
import queue
import threading
import time

from common.tokenizer import Tokenizer
from coordinator.engine import Engine
from coordinator.jobs import Job
from coordinator.results import result_record
from coordinator.sequence import Sequence

log = logging.getLogger(__name__)


class EngineLoop(threading.Thread):
    def __init__(self, engine: Engine, tokenizer: Tokenizer) -> None:
        super().__init__(name="engine", daemon=True)
        self.engine = engine
        self.tokenizer = tokenizer
        self.inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, tuple[Job, Sequence, object]] = {}
        self._stop = threading.Event()
        self.ticks = 0
        self.last_progress = time.monotonic()

    # ---- called from gRPC threads --------------------------------------------------
    def submit(self, job: Job) -> None:
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("stop", None))

    # ---- the engine thread ---------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work)
            if self._stop.is_set():
                break
            if self.engine.has_work:
                self._tick()

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, job: Job | None) -> None:
        if kind == "submit" and job is not None and not job.finished:
            seq = self.engine.submit(job.prompt, job.params)
            job.seq_id = seq.seq_id
            self._jobs[seq.seq_id] = (job, seq, self.tokenizer.detokenizer())
        elif kind == "cancel" and job is not None and job.seq_id in self._jobs:
            _, seq, _ = self._jobs[job.seq_id]
            self.engine.cancel(seq)
            self._finish(seq, "cancelled")

    def _tick(self) -> None:
        try:
            commits = self.engine.step()
        except Exception as e:  # a worker failed mid-forward: its sequences cannot go on
            log.error("forward failed: %s", e)
            failed = self.engine.fail_running(str(e))
            for seq in failed:
                self._finish(seq, "failed", error=str(e))
            try:  # best effort: reachable workers drop the rows now
                self.engine.pipeline.release([s.seq_id for s in failed])
            except Exception as release_error:
                log.warning("could not release KV after a failure: %s", release_error)
            return
        self.ticks += 1
        self.last_progress = time.monotonic()
        for commit in commits:
            entry = self._jobs.get(commit.seq.seq_id)
            if entry is None:
                continue
            job, seq, detok = entry
            if commit.tokens:
                job.publish(commit.tokens, detok.add(commit.tokens))
            if seq.finished:
                self._finish(seq, "done")

    def _finish(self, seq: Sequence, state: str, error: str = "") -> None:
        entry = self._jobs.pop(seq.seq_id, None)
        if entry is None:
            return
        job, _, detok = entry
        tail = detok.finish()  # text the streaming detokenizer held back
        if tail:
            job.publish([], tail)
        record = result_record(seq, self.tokenizer.text(seq.output), error)
        job.finish(state, record)
