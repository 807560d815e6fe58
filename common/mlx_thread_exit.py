"""The last MLX call of a thread that used MLX (the engine thread, the planner thread, a
worker's MLX thread)."""

from __future__ import annotations

import logging

import mlx.core as mx

log = logging.getLogger(__name__)


def release_mlx_thread() -> None:
    """Wait for the work this thread started, then drop its per-thread MLX state (streams,
    compile cache, random key) while it holds the GIL.

    MLX keeps that state in C++ thread_locals, and the random key's destructor (created by
    any random draw, and by importing mlx_lm, whose samplers read `mx.random.state`) takes
    the GIL when the OS thread exits. Python's `join` returns before that: if the main thread
    is finalizing the interpreter by then, taking the GIL ends the thread by a forced unwind
    inside that destructor, and libstdc++ aborts the process ("terminate called without an
    active exception", SIGABRT). `mx.clear_streams` is MLX's call for this cleanup: after
    it the destructors have nothing left to do. The thread must run no MLX work after it."""
    try:
        mx.synchronize()
    except Exception as e:  # a failed forward's error; its jobs have been told already
        log.warning("MLX work failed while stopping: %s", e)
    mx.clear_streams()
