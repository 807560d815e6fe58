"""How fast this process's default MLX device reads memory: the figure `--tp auto` divides
a stage's weight bytes by (decoding reads every weight once per token). Measured once per
process, on the thread that owns MLX, by timing a sum over a large array: no chip tables."""

from __future__ import annotations

import functools
import time

import mlx.core as mx

# Large enough that a GPU's launch cost is small beside the read; a CPU's caches are far
# smaller than 64 MiB, and its sums are slow enough that 256 MiB would cost half a second.
GPU_PROBE_BYTES = 256 << 20
CPU_PROBE_BYTES = 64 << 20
REPEATS = 3


def measure(nbytes: int | None = None, repeats: int = REPEATS) -> float:
    """Bytes per second of the best of `repeats` sums over `nbytes` of float32."""
    if nbytes is None:
        on_gpu = mx.default_device() == mx.gpu
        nbytes = GPU_PROBE_BYTES if on_gpu else CPU_PROBE_BYTES
    data = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(data)
    mx.eval(data.sum())  # the first run compiles the kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(data.sum())
        best = min(best, time.perf_counter() - start)
    del data
    mx.clear_cache()  # give the probe's buffer back
    return nbytes / max(best, 1e-9)


@functools.cache
def read_bandwidth() -> float:
    """This process's figure, measured on the first call (call it on the MLX thread)."""
    return measure()
