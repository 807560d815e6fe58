"""The thread that owns MLX in the coordinator: it takes new jobs and cancellations from a
queue, ticks the engine, publishes each tick's commits to the jobs, and keeps the metrics.
Its last act is `release_mlx_thread`, and CoordinatorServer.stop joins it."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from common.errors import WedlmError
from common.mlx_thread_exit import release_mlx_thread
from common.tokenizer import TextStream, Tokenizer
from coordinator.engine.engine import Engine
from coordinator.engine.pipeline import Pipeline
from coordinator.engine.prefix_cache import CacheStats
from coordinator.engine.scheduler import QueueFull
from coordinator.engine.sequence import Phase, Sequence
from coordinator.service.jobs import Job
from coordinator.service.metrics import Metrics
from coordinator.service.results import error_record, result_record

log = logging.getLogger(__name__)


class _Live:
    """A job being decoded: its sequence, text stream and latency bookkeeping."""

    def __init__(self, job: Job, seq: Sequence, stream: TextStream) -> None:
        self.job, self.seq, self.stream = job, seq, stream
        self.started: float | None = None  # admitted to running
        self.last_token: float | None = None


MAX_FAILED_RECOVERIES = 3  # recoveries in a row whose next forward fails again


class EngineLoop(threading.Thread):
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        metrics: Metrics | None = None,
        recover: Callable[[Exception | None], tuple[Pipeline, int] | None] | None = None,
        on_replan: Callable[[], None] | None = None,
    ):
        super().__init__(name="engine", daemon=True)
        self.recover = recover  # blocks until a new pipeline is ready (or gives up)
        self.on_replan = on_replan  # runs on the new pipeline before sequences resume
        self.recoveries: list[float] = []  # seconds each recovery took
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics or Metrics()
        self.inbox: queue.Queue = queue.Queue()
        self._live: dict[int, _Live] = {}
        self._stopping = threading.Event()
        self._replan: str | None = None  # why the pipeline should be planned anew
        self.ticks = 0
        self.last_progress = time.monotonic()
        self._cache_seen = CacheStats()  # prefix-cache counts already exported
        self._failures = 0  # forwards failed since the last tick that worked

    # ---- called from gRPC threads --------------------------------------------------
    def submit(self, job: Job) -> None:
        self.inbox.put(("submit", job))

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        self.inbox.put(("cancel", job, reason))

    def request_replan(self, reason: str) -> None:
        """Plan the pipeline anew at the next tick (a worker joined): in-flight forwards
        are dropped and every live sequence re-prefills, as after a loss."""
        self._replan = reason
        self.inbox.put(("wake", None))

    def stop(self) -> None:
        """Ask the thread to end after the tick in progress (join it to wait for that)."""
        self._stopping.set()
        self.inbox.put(("stop", None))

    # ---- the engine thread ---------------------------------------------------------
    def run(self) -> None:
        try:
            self._serve()
        finally:
            release_mlx_thread()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            self._drain(block=not self.engine.has_work)
            if self._stopping.is_set():
                break
            if self._replan is not None:
                reason, self._replan = self._replan, None
                log.warning("re-planning: %s", reason)
                if not self._recover(None):
                    self._fail_running(WedlmError(f"re-planning failed ({reason})"))
            self._expire()
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

    def _handle(self, kind: str, job: Job | None, reason: str = "cancelled") -> None:
        if kind == "wake":
            return
        if kind == "submit" and job is not None and not job.finished:
            try:
                seq = self.engine.submit(job.prompt, job.params)
            except QueueFull as e:  # a backstop: the servicer checks the limits first
                job.finish("failed", error_record(len(job.prompt), str(e)))
                return
            job.seq_id = seq.seq_id
            self._live[seq.seq_id] = _Live(job, seq, self.tokenizer.detokenizer())
        elif kind == "cancel" and job is not None and job.seq_id in self._live:
            self._end(self._live[job.seq_id], "cancelled", reason)

    def _expire(self) -> None:
        now = time.time()
        for live in list(self._live.values()):
            deadline = live.job.deadline
            if deadline is not None and now > deadline:
                self._end(live, "cancelled", reason="deadline")

    def _end(self, live: _Live, state: str, reason: str = "cancelled") -> None:
        self.engine.cancel(live.seq)
        live.seq.finish_reason = reason
        self._finish(live.seq, state)

    def _tick(self) -> None:
        try:
            commits = self.engine.step()
        except Exception as e:  # a worker failed mid-forward, or this process's own layers
            log.error("forward failed: %s", e)
            self._deliver(self.engine.take_undelivered())  # finished before the failure
            self._failures += 1
            # Re-planning replaces lost workers and a broken relay chain; a failure that
            # comes back right after it (this process's own stage out of memory, say) is
            # not mended by another: the running requests fail instead of looping.
            if self._failures <= MAX_FAILED_RECOVERIES:
                if not self._recover(e):
                    self._fail_running(e)
                return
            self._fail_running(e)
            self._failures = 0
            self._recover(e)  # a fresh pipeline for later requests (no forwards in flight)
            return
        self._failures = 0
        self.ticks += 1
        self.last_progress = time.monotonic()
        self._deliver(commits)
        self._gauges()

    def _fail_running(self, error: Exception) -> None:
        failed = self.engine.fail_all()
        for seq in failed:
            self._finish(seq, "failed", error=str(error))
        try:  # best effort: reachable workers drop the rows now
            self.engine.pipeline.release([s.seq_id for s in failed])
        except Exception as release_error:
            log.warning("could not release KV after a failure: %s", release_error)

    def _deliver(self, commits) -> None:
        now = time.monotonic()
        for commit in commits:
            live = self._live.get(commit.seq.seq_id)
            if live is None:
                continue
            if commit.tokens:
                self._observe_tokens(live, len(commit.tokens), now)
                live.job.publish(commit.tokens, live.stream.add(commit.tokens))
            if commit.seq.finished:
                self._finish(commit.seq, "done")
        self._mark_started(now)

    def _recover(self, error: Exception | None) -> bool:
        """Re-plan over the workers that are left (or wait for one), then rebuild every
        live sequence's KV from its tokens. Jobs are paused, not lost."""
        if self.recover is None:
            return False
        start = time.monotonic()
        result = self.recover(error)
        if result is None:
            return False
        pipeline, micro_batches = result
        self.engine.restart_on(pipeline, micro_batches)
        if self.on_replan is not None:
            self.on_replan()
        self.recoveries.append(time.monotonic() - start)
        log.warning("recovered in %.2f s; rebuilding KV", self.recoveries[-1])
        return True

    def _mark_started(self, now: float) -> None:
        for live in self._live.values():
            if live.started is None and live.seq.phase is not Phase.WAITING:
                live.started = now
                live.job.mark_running()
                self.metrics.queue_time.observe(time.time() - live.job.created_at)

    def _observe_tokens(self, live: _Live, count: int, now: float) -> None:
        m = self.metrics
        m.generation_tokens.inc(count)
        if live.last_token is None:
            m.ttft.observe(time.time() - live.job.created_at)
        else:  # tokens committed together share the gap since the previous commit
            gap = (now - live.last_token) / count
            for _ in range(count):
                m.itl.observe(gap)
        live.last_token = now

    def _gauges(self) -> None:
        m, engine = self.metrics, self.engine
        m.running.set(len(engine.running))
        m.waiting.set(len(engine.waiting))
        m.kv_rows.set(sum(s.kv_length for s in engine.running))
        m.in_flight.set(len(engine.in_flight))
        m.forward_shapes.set(engine.shapes.count)
        for link in getattr(engine.pipeline, "links", []):
            for value in link.stats.drain_new():
                m.worker_compute.labels(link.address).observe(value)
        cache = engine.prefix_cache
        if cache is not None:
            m.prefix_cache_tokens.set(cache.tokens)
            m.prefix_cache_entries.set(len(cache.entries))
            now, seen = cache.stats, self._cache_seen
            m.prefix_cache_queries.inc(now.lookups - seen.lookups)
            m.prefix_cache_hits.inc(now.hits - seen.hits)
            m.prefix_cache_hit_tokens.inc(now.hit_tokens - seen.hit_tokens)
            m.prefix_cache_evictions.inc(now.evictions - seen.evictions)
            self._cache_seen = replace(now)

    def _finish(self, seq: Sequence, state: str, error: str = "") -> None:
        live = self._live.pop(seq.seq_id, None)
        if live is None:
            return
        tail = live.stream.finish()  # text the streaming detokenizer held back
        if tail:
            live.job.publish([], tail)
        record = result_record(seq, self.tokenizer.text(seq.output), error)
        m = self.metrics
        m.prompt_tokens.inc(seq.prefilled)
        m.decode_forwards.inc(seq.forwards)
        m.requests.labels(seq.finish_reason or state).inc()
        m.e2e.observe(time.time() - live.job.created_at)
        if seq.forwards:
            m.tokens_per_forward.observe(len(seq.output) / seq.forwards)
        if seq.params.mode == "speculative":
            m.drafted_tokens.inc(seq.drafted)
            m.accepted_drafts.inc(seq.accepted)
            if seq.forwards:
                m.accepted_per_forward.observe(seq.accepted / seq.forwards)
        if seq.params.mode == "diffusion" and seq.canvases:
            m.diffusion_canvases.inc(seq.canvases)
            m.steps_per_canvas.observe(seq.forwards / seq.canvases)
        if len(seq.output) > 1 and seq.decode_s:
            m.tpot.observe(seq.decode_s / (len(seq.output) - 1))
        live.job.finish(state, record)
