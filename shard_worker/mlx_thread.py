"""The one thread that runs MLX in a worker. MLX is not thread-safe, so gRPC handler
threads never touch it: they submit jobs here and wait on a Future.

Forwards are pipelined jobs in two halves: `launch` builds the graph and starts the device,
`finish` waits for it and hands the result on. When the next forward is already queued, it
is launched before the previous one is finished, so the host builds micro-batch k+1 while
the device computes k (as mlx-lm overlaps its steps in one process).

Stopping waits for the thread to end, and the thread's last act is `release_mlx_thread`:
MLX's per-thread state must be dropped on its own thread, before the interpreter shuts down
(see there)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from common.mlx_thread_exit import release_mlx_thread

log = logging.getLogger(__name__)
QUEUE_LIMIT = 64  # jobs waiting; more is overload, answered with RESOURCE_EXHAUSTED
OVERLAP = 2  # pipelined jobs launched and not yet finished, at most
STOP_TIMEOUT_S = 60.0  # for the jobs queued and the forwards launched, at stop


class QueueFull(Exception):
    """The MLX thread already has QUEUE_LIMIT jobs waiting."""


class ThreadStopped(Exception):
    """The MLX thread is shutting down and accepts no more work."""


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple
    future: Future
    alive: Callable[[], bool] | None
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Pipelined:
    launch: Callable[[], Any]
    finish: Callable[[Any], Any]
    done: Callable[[Any, float], None]  # (result or exception, seconds queued)
    submitted: float = field(default_factory=time.perf_counter)


class MLXThread:
    def __init__(self, limit: int = QUEUE_LIMIT) -> None:
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=limit)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mlx", daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[..., Any], *args: Any, alive: Callable[[], bool] | None = None
    ) -> Future:
        """Run fn(*args) on the MLX thread. The Future gets `queue_s`, the seconds the job
        waited. `alive` is asked just before running: a job whose caller has gone (a
        cancelled RPC) is skipped."""
        if self._stopping:
            raise ThreadStopped("the worker is shutting down")
        job = _Job(fn, args, Future(), alive)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self._jobs.maxsize} jobs are already waiting") from None
        return job.future

    def submit_pipelined(
        self,
        launch: Callable[[], Any],
        finish: Callable[[Any], Any],
        done: Callable[[Any, float], None],
    ) -> None:
        """Run finish(launch()) on the MLX thread, overlapping with the next pipelined job;
        `done(result_or_exception, queue_s)` is called there, in submission order (a job
        whose launch fails reports at once)."""
        if self._stopping:
            raise ThreadStopped("the worker is shutting down")
        try:
            self._jobs.put_nowait(_Pipelined(launch, finish, done))
        except queue.Full:
            raise QueueFull(f"{self._jobs.maxsize} jobs are already waiting") from None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Submit and wait (for setup work: loading layers before serving)."""
        return self.submit(fn, *args).result()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Take no more work, finish what is queued and launched, then end the thread and
        wait for it (up to `timeout` s): no MLX work may be left running when the process
        exits. Returns whether the thread ended."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        with contextlib.suppress(queue.Full):  # the thread is stuck on a job: said below
            self._jobs.put(None, timeout=timeout)
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            log.error("the MLX thread did not stop within %g s", timeout)
            return False
        return True

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            release_mlx_thread()

    def _serve(self) -> None:
        launched: deque[tuple[_Pipelined, Any, float]] = deque()
        while True:
            try:  # with forwards on the device, take only work that is already here
                job = self._jobs.get(block=not launched)
            except queue.Empty:
                self._finish(*launched.popleft())
                continue
            if job is None:
                break
            if isinstance(job, _Pipelined):
                queued = time.perf_counter() - job.submitted
                try:
                    launched.append((job, job.launch(), queued))
                except BaseException as e:
                    job.done(e, queued)
                if len(launched) >= OVERLAP:
                    self._finish(*launched.popleft())
                continue
            while launched:  # other work sees every forward before it completed
                self._finish(*launched.popleft())
            if job.alive is not None and not job.alive():
                job.future.cancel()
                continue
            if not job.future.set_running_or_notify_cancel():
                continue
            job.future.queue_s = time.perf_counter() - job.submitted
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as e:  # handed to the waiting handler, which maps it
                job.future.set_exception(e)
        while launched:
            self._finish(*launched.popleft())

    @staticmethod
    def _finish(job: _Pipelined, state: Any, queued: float) -> None:
        try:
            result = job.finish(state)
        except BaseException as e:
            result = e
        try:
            job.done(result, queued)
        except Exception:  # a bug in the receiver must not stop the MLX thread
            log.exception("a forward's result could not be handed on")
