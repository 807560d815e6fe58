"""The thread that owns MLX in the coordinator: it takes new jobs and cancellations from a
queue, ticks the engine, publishes each tick's commits to the jobs (live_jobs.py), and keeps
the metrics.
Its last act is `release_mlx_thread`, and CoordinatorServer.stop joins it.

An unexpected error fails the requests it touched (one request's, when it came from that
request's work; else those running), is logged with its traceback, and the thread goes on
serving the others. Only when it cannot go on (errors in a row, or its own error handling
failing) does it end (`dead`): every open request fails, and the process exits (server_cli)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from common.errors import WedlmError, is_out_of_memory
from common.mlx_thread_exit import release_mlx_thread
from common.tokenizer import Tokenizer
from coordinator.engine.engine import Engine
from coordinator.engine.pipeline import Pipeline
from coordinator.engine.prefix_cache import CacheStats
from coordinator.engine.sequence import Phase
from coordinator.service.fault_hooks import (
    ENGINE_CRASH_FAULT,
    OUT_OF_MEMORY_FAULT,
    REQUEST_ERROR_FAULT,
    FaultFile,
    InjectedFault,
    fail_next_collect,
    parse_fault,
)
from coordinator.service.jobs import Job
from coordinator.service.live_jobs import LiveJobs
from coordinator.service.messages import Cancel, Inbox, Stop, Submit, Wake
from coordinator.service.metrics import Metrics
from coordinator.service.results import (
    ENGINE_STOPPED,
    OUT_OF_MEMORY,
    error_record,
)

log = logging.getLogger(__name__)


MAX_FAILED_RECOVERIES = 3  # recoveries in a row whose next forward fails again
# After a forward ran out of memory, the KV admission budget is at most this share of the
# KV the running sequences could need: fewer run at once, and each repeat shrinks it more.
OOM_BUDGET_SHARE = 0.75
MAX_LOOP_ERRORS = 3  # unexpected errors with no clean pass between: the engine is broken


class IdleWork(Protocol):
    """Work the engine thread does a step at a time while it has nothing else to do."""

    def due(self) -> bool: ...  # a step should run now

    def step(self) -> None: ...  # one short step (a request waits for it at most)


class EngineBroken(RuntimeError):
    """The engine thread cannot go on: it ends, failing every open request."""


class EngineLoop(threading.Thread):
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        metrics: Metrics | None = None,
        recover: Callable[[Exception | None], tuple[Pipeline, int] | None] | None = None,
        on_replan: Callable[[], None] | None = None,
        measure_kv_budget: Callable[[], int | None] | None = None,
        idle_work: IdleWork | None = None,
    ):
        super().__init__(name="engine", daemon=True)
        self.idle_work = idle_work  # run a step at a time while idle (startup_costs.py)
        self.recover = recover  # blocks until a new pipeline is ready (or gives up)
        self.on_replan = on_replan  # runs on the new pipeline before sequences resume
        self.measure_kv_budget = measure_kv_budget  # KV tokens the stages' free memory holds
        self.faults = FaultFile.from_env()  # test hooks (fault_hooks.py); None normally
        self.dead: str | None = None  # why the thread ended unexpectedly (then it serves none)
        self._door = threading.Lock()  # a submit either reaches the inbox or sees `dead`
        self.out_of_memory = 0  # forwards that ran out of memory
        self._budget_shrunk = False  # by an out-of-memory forward: measured again when idle
        self.recoveries: list[float] = []  # seconds each recovery took
        # each re-plan, for the console: when it ended (epoch s), how long, and why
        self.recovery_log: deque[dict] = deque(maxlen=64)
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics or Metrics()
        self.inbox: queue.Queue = queue.Queue()
        self.live = LiveJobs(engine, tokenizer, self.metrics)  # the jobs being decoded
        self._stopping = threading.Event()
        self._replan: str | None = None  # why the pipeline should be planned anew
        self._last_replan = ""  # the reason of the re-plan asked last (recovery_log)
        self.ticks = 0
        self.last_progress = time.monotonic()
        self._cache_seen = CacheStats()  # prefix-cache counts already exported
        self._failures = 0  # forwards failed since the last tick that worked

    # ---- called from gRPC threads --------------------------------------------------
    def submit(self, job: Job, choices: tuple[Job, ...] = ()) -> None:
        """`choices`: the request's other choices (n > 1), which share `job`'s prompt rows."""
        with self._door:
            if self.dead is None:
                self.inbox.put(Submit(job, choices))
                return
        for each in (job, *choices):
            each.finish("failed", error_record(len(each.prompt), self._death_message(),
                                               ENGINE_STOPPED))  # fmt: skip

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        self.inbox.put(Cancel(job, reason))

    def request_replan(self, reason: str) -> None:
        """Plan the pipeline anew at the next tick (a worker joined): in-flight forwards
        are dropped and every live sequence re-prefills, as after a loss."""
        self._replan = reason
        self.inbox.put(Wake())

    def stop(self) -> None:
        """Ask the thread to end after the tick in progress (join it to wait for that)."""
        self._stopping.set()
        self.inbox.put(Stop())

    # ---- the engine thread ---------------------------------------------------------
    def run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug: say so everywhere rather than hang requests
            log.critical("the engine thread stopped: %s", e, exc_info=e)
            self._die(e)
        finally:
            release_mlx_thread()

    def _death_message(self) -> str:
        return f"the coordinator's engine stopped ({self.dead}); it serves no requests"

    def _die(self, error: BaseException) -> None:
        """End every accepted request with an error at once, and refuse later ones (the
        server's readiness and liveness report it: restart the coordinator)."""
        with self._door:
            self.dead = f"{type(error).__name__}: {error}"
        message = self._death_message()
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Submit):
                for job in (item.job, *item.choices):
                    job.finish("failed", error_record(len(job.prompt), message, ENGINE_STOPPED))
        with contextlib.suppress(Exception):  # the engine's state may be what broke
            self.engine.fail_all()
        lives = list(self.live.by_seq.values())
        with contextlib.suppress(Exception):
            self.engine.fail([live.seq for live in lives])
        for live in lives:
            self.live.finish(live.seq, "failed", message, ENGINE_STOPPED)

    def _serve(self) -> None:
        errors = 0  # unexpected errors since the last pass that went through
        while not self._stopping.is_set():
            try:
                self._pass()
            except EngineBroken:
                raise
            except Exception as e:  # a bug: fail what it touched, serve the others
                errors += 1
                log.error("the engine thread hit an unexpected error (%d in a row): %s",
                          errors, e, exc_info=e)  # fmt: skip
                if errors >= MAX_LOOP_ERRORS:
                    raise EngineBroken(
                        f"{errors} unexpected errors in a row, the last {type(e).__name__}: {e}"
                    ) from e
                self._fail_touched(e)
            else:
                errors = 0

    def _pass(self) -> None:
        """Take what the inbox holds, then tick once (or, idle, re-plan if a stage is gone)."""
        if self._budget_shrunk and not self.engine.has_work:
            self._measure_budget_again()
        idle = self.idle_work is not None and not self.engine.has_work and self.idle_work.due()
        self._drain(block=not self.engine.has_work and not idle)
        if self._stopping.is_set():
            return
        if self._replan is not None:
            reason, self._replan = self._replan, None
            self._last_replan = reason
            log.warning("re-planning: %s", reason)
            if not self._recover(None):
                self._fail_running(WedlmError(f"re-planning failed ({reason})"))
        self.live.expire()
        if self.engine.has_work:
            self._tick()
        elif (broken := getattr(self.engine.pipeline, "broken", None)) is not None:
            # idle, and the heartbeat found a stage gone: re-plan now, not at the next
            # request (status and the console show the new plan within seconds)
            log.warning("re-planning while idle: %s", broken)
            self._recover(broken)
        elif idle and not self._replan:
            self.idle_work.step()

    def _fail_touched(self, error: Exception) -> None:
        """After an unexpected error outside one request's work: the requests running may
        be what it broke, so they fail (cancelled in the engine, their KV released as
        after a cancellation); those still waiting were not touched and stay queued."""
        lives = self.live.by_seq.values()
        touched = [live for live in lives if live.seq.phase is not Phase.WAITING]
        message = (
            f"the coordinator's engine failed this request: {type(error).__name__}: {error} "
            f"(it goes on serving other requests)"
        )
        try:
            for live in touched:
                self.engine.cancel(live.seq, "error")
        except Exception as e:  # the engine cannot even cancel: it cannot go on
            raise EngineBroken(f"cannot cancel requests after {error!r}: {e!r}") from e
        for live in touched:
            self.live.finish(live.seq, "failed", message)

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, message: Inbox) -> None:
        match message:
            case Submit(job, choices):
                leader = self.live.start(job)
                for choice in choices:
                    self.live.start(choice, leader)
            case Cancel(job, reason) if job.seq_id in self.live.by_seq:
                self.live.end(self.live.by_seq[job.seq_id], "cancelled", reason)
            case _:  # Wake, Stop (the loop reads its flags), or nothing left to do
                pass

    def _tick(self) -> None:
        fault, argument = parse_fault(self.faults.take() if self.faults is not None else None)
        if fault == ENGINE_CRASH_FAULT:
            raise EngineBroken("injected engine crash")
        if fault == REQUEST_ERROR_FAULT:
            self.live.request_fault = argument
        if fault == OUT_OF_MEMORY_FAULT:
            error = InjectedFault("[metal::malloc] out of memory (injected)")
            fail_next_collect(self.engine.pipeline, error)
        try:
            commits = self.engine.step()
        except Exception as e:  # a worker failed mid-forward, or this process's own layers
            self.live.deliver(self.engine.take_undelivered())  # finished before the failure
            # A broken relay chain needs a re-plan, whatever the worker's error said.
            if is_out_of_memory(e) and getattr(self.engine.pipeline, "broken", None) is None:
                self._out_of_memory(e)
                return
            log.error("forward failed: %s", e)
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
        self.live.deliver(commits)
        self._gauges()

    def _out_of_memory(self, error: Exception) -> None:
        """Memory is a resource, not a fault: no re-plan. The running sequences wait in the
        queue again (their tokens kept), admission's KV budget shrinks to what is free now
        and below what failed, and a sequence that failed alone, or that no longer fits the
        budget, fails with OUT_OF_MEMORY."""
        engine, scheduler = self.engine, self.engine.scheduler
        self.out_of_memory += 1
        self.metrics.out_of_memory.inc()
        in_use = scheduler.kv_in_use()
        try:
            back = engine.requeue_for_memory()
        except Exception as e:  # the stages did not answer: mend it as any forward failure
            log.error("could not requeue after running out of memory: %s", e)
            if not self._recover(e):
                self._fail_running(e)
            return
        limits = engine.limits
        measured = self.measure_kv_budget() if self.measure_kv_budget is not None else None
        known = [b for b in (measured, limits.kv_tokens) if b is not None]
        before = limits.kv_tokens
        alone = len(back) == 1  # it fails: the others need no smaller budget for its sake
        share = [] if alone else [int(in_use * OOM_BUDGET_SHARE)]
        budget = max(1, min([*known, *share])) if known or share else None
        engine.change_limits(kv_tokens=budget)
        self._budget_shrunk = True
        too_big = back if alone else [s for s in back if scheduler.kv_need(s) > budget]
        engine.fail(too_big)
        for seq in too_big:
            need = scheduler.kv_need(seq)
            self.live.finish(
                seq,
                "failed",
                f"out of memory: this request may need {need} KV rows and its forward ran out "
                f"of memory{' even alone' if alone else ''}; the stages' free memory now "
                f"holds {limits.kv_tokens} (lower max_tokens, shorten the prompt, or retry "
                f"later)",
                OUT_OF_MEMORY,
            )
        log.warning(
            "a forward ran out of memory (%s): %d requests wait to run again, %d failed; "
            "KV admission budget %s -> %s tokens until the engine is idle",
            error, len(back) - len(too_big), len(too_big), before, limits.kv_tokens,
        )  # fmt: skip

    def _measure_budget_again(self) -> None:
        """Idle after running out of memory: what was short then (another process's peak,
        a burst of long requests) may be free again, so admission goes by a new measure."""
        self._budget_shrunk = False
        if self.measure_kv_budget is None:
            return
        before = self.engine.limits.kv_tokens
        self.engine.change_limits(kv_tokens=self.measure_kv_budget())
        log.info("idle after running out of memory: KV admission budget %s -> %s tokens",
                 before, self.engine.limits.kv_tokens)  # fmt: skip

    def _fail_running(self, error: Exception) -> None:
        failed = self.engine.fail_all()
        for seq in failed:
            self.live.finish(seq, "failed", error=str(error))
        try:  # best effort: reachable workers drop the rows now
            self.engine.pipeline.release([s.seq_id for s in failed])
        except Exception as release_error:
            log.warning("could not release KV after a failure: %s", release_error)

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
        why = str(error) if error is not None else (self._last_replan or "re-plan")
        self.recovery_log.append({"at": time.time(), "seconds": self.recoveries[-1],
                                  "reason": why, "lost": error is not None})  # fmt: skip
        log.warning("recovered in %.2f s; rebuilding KV", self.recoveries[-1])
        return True

    def _gauges(self) -> None:
        m, engine = self.metrics, self.engine
        m.running.set(len(engine.running))
        m.waiting.set(len(engine.waiting))
        m.kv_rows.set(sum(s.kv_length for s in engine.running))
        m.in_flight.set(len(engine.in_flight))
        m.forward_shapes.set(engine.shapes.count)
        cost = engine.step_cost  # measured at warm-up, refined online; nothing known: 1.0
        for rows, ratio in (cost.describe() or {1: cost.break_even(1)}).items():
            m.draft_break_even.labels(str(rows)).set(ratio)
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
