"""The one thread that runs MLX in a worker. MLX is not thread-safe, so gRPC handler
threads never touch it: they submit jobs here and wait on a Future."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
QUEUE_LIMIT = 64  # jobs waiting; more is overload, answered with RESOURCE_EXHAUSTED


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

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Submit and wait (for setup work: loading layers before serving)."""
        return self.submit(fn, *args).result()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        try:
            self._jobs.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
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
