"""The tests' name for devtools/cluster_harness.py (real coordinator and worker processes on
127.0.0.1), which benchmarks/dev/ shares: the harness lives outside tests/."""

from devtools.cluster_harness import (
    STARTUP_TIMEOUT_S,
    HttpCoordinator,
    Proc,
    cluster_name,
    engine_outputs,
    free_port,
    gpu_env,
    http_coordinator,
    spawn,
    spawn_command,
    start_coordinator,
    start_fetching_worker,
    start_worker,
    wait_until,
    worker_info,
    worker_kv_sequences,
)

__all__ = [
    "STARTUP_TIMEOUT_S",
    "HttpCoordinator",
    "Proc",
    "cluster_name",
    "engine_outputs",
    "free_port",
    "gpu_env",
    "http_coordinator",
    "spawn",
    "spawn_command",
    "start_coordinator",
    "start_fetching_worker",
    "start_worker",
    "wait_until",
    "worker_info",
    "worker_kv_sequences",
]
