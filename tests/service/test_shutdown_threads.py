"""Threads that run MLX end cleanly: stopping one waits for it, and its last act, on its own
thread, is to release its per-thread MLX state. Left to MLX's C++ thread_local destructors,
that state (the random key) takes the GIL as the OS thread exits; when that happens while
the interpreter finalizes, the process aborts with SIGABRT ("terminate called without an
active exception") instead of exiting 0 after SIGTERM."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import mlx.core as mx

from coordinator.service import engine_loop
from shard_worker import mlx_thread


def _recording(monkeypatch, module) -> list[str]:
    """Names of the threads that release their MLX state (the real release still runs)."""
    released: list[str] = []
    real = module.release_mlx_thread

    def record() -> None:
        released.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(module, "release_mlx_thread", record)
    return released


def test_mlx_thread_releases_its_state_and_stop_joins_it(monkeypatch):
    released = _recording(monkeypatch, mlx_thread)
    worker = mlx_thread.MLXThread()
    # a random draw gives the thread its own random key, as importing mlx_lm does
    assert worker.call(lambda: mx.random.normal((4,)).shape) == (4,)
    assert worker.stop(timeout=30)
    assert not worker._thread.is_alive()
    assert released == ["mlx"]
    # MLX still works on the calling thread
    assert mx.random.normal((2,)).shape == (2,)


def test_mlx_thread_stop_finishes_queued_work_first():
    worker = mlx_thread.MLXThread()
    futures = [worker.submit(lambda i=i: mx.array(i).item()) for i in range(5)]
    assert worker.stop(timeout=30)
    assert [f.result(0) for f in futures] == list(range(5))


def test_engine_loop_releases_its_state_on_its_own_thread(monkeypatch):
    released = _recording(monkeypatch, engine_loop)
    engine = SimpleNamespace(has_work=False)
    loop = engine_loop.EngineLoop(engine, tokenizer=None)
    loop.start()
    loop.stop()
    loop.join(30)
    assert not loop.is_alive()
    assert released == ["engine"]
