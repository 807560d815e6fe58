"""What a process can say about the machine it runs on: device, memory, a node name.
Workers advertise these so the coordinator can plan layer ranges by memory."""

from __future__ import annotations

import os
import platform
import re
import socket
from functools import cache

import mlx.core as mx
import psutil


def _mlx_device_info() -> dict:
    try:
        return dict(mx.device_info())
    except (AttributeError, RuntimeError):  # older MLX, or no usable backend
        return {}


@cache
def _on_gpu() -> bool:
    return mx.default_device().type == mx.gpu


@cache
def _gpu_memory_cap() -> int:
    """Metal's per-process budget (a CUDA GPU: its own memory). Cached: later calls (from
    gRPC threads) touch no MLX."""
    info = _mlx_device_info()
    keys = ("max_recommended_working_set_size", "memory_size", "total_memory")
    return int(next((info[k] for k in keys if info.get(k)), 0))


def device_description() -> str:
    """E.g. "gpu: Apple M2 Max" or "cpu: AMD EPYC (Linux x86_64, 16 cores)"."""
    info = _mlx_device_info()
    if _on_gpu():
        name = info.get("device_name") or info.get("architecture") or "unknown"
        return f"gpu: {name}"
    name = info.get("device_name") or platform.processor() or platform.machine() or "unknown"
    cores = psutil.cpu_count(logical=True) or os.cpu_count() or 0
    return f"cpu: {name} ({platform.system()} {platform.machine()}, {cores} cores)"


def wire_model_memory() -> None:
    """As mlx-lm does for generation: on a Mac, let Metal keep up to the recommended
    working set wired (resident), so the weights are not paged out between forwards.
    A no-op where the device reports no recommended size (CPU, CUDA). Call once, from the
    thread that owns MLX, before loading weights."""
    if not mx.metal.is_available():  # the no-op, without importing mlx_lm.utils (seconds:
        return  # it imports transformers, and with it torch where that is installed)
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    maybe_set_recommended_wired_limit()


def memory() -> tuple[int, int]:
    """(total, available) bytes this process can fill with weights and KV.

    On Apple silicon the GPU shares system memory but Metal caps one process at the
    recommended working set, so that cap bounds both numbers. Call it once from the MLX
    thread (or before serving) so that the MLX queries are cached.
    """
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    if _on_gpu() and (cap := _gpu_memory_cap()):
        # What MLX holds counts against the cap (on a Mac it is in `vm` already; a GPU with
        # its own memory does not show it there)
        held = mx.get_active_memory()
        total, available = min(total, cap), max(min(available, cap - held), 0)
    return total, available


def node_id(port: int, name: str | None = None) -> str:
    """A name stable for this host and port, usable as a DNS-SD instance label."""
    if name:
        return name
    host = socket.gethostname().split(".")[0] or "worker"
    host = re.sub(r"[^A-Za-z0-9-]+", "-", host).strip("-").lower() or "worker"
    return f"{host}-{port}"
