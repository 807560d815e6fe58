"""Processes of benchmarks/dev/tp_gpu.py: a command under `mlx.launch` (N ranks on this host,
`nccl` with one CUDA_VISIBLE_DEVICES per rank as mlx.launch sets it, or `ring` on
127.0.0.1), or alone on one GPU; and a run of this script's rank tasks that hands back rank
0's result file."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from devtools.cluster_harness import spawn_command

ROOT = Path(__file__).resolve().parents[2]
TP_GPU = ROOT / "benchmarks" / "dev" / "tp_gpu.py"
# mlx.launch's own entry point, so that a `python3` without the console script runs it too
MLX_LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]


def default_backend() -> str:
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() else "ring"


def _consecutive_free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free now (ring ranks listen on consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        socks = []
        try:
            for p in range(first, first + n):
                sk = socket.socket()
                socks.append(sk)
                sk.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def launched(argv: list[str], tp: int, backend: str) -> list[str]:
    """argv as each of `tp` ranks on this host under mlx.launch."""
    if backend == "nccl":
        port = ["--nccl-port", str(_consecutive_free_ports(1))]
    elif backend == "ring":
        port = ["--starting-port", str(_consecutive_free_ports(tp))]
    else:
        raise ValueError(f"backend {backend!r}: this script launches nccl or ring")
    return [*MLX_LAUNCH, "-n", str(tp), "--backend", backend, *port, "--", *argv]


def one_gpu_env() -> dict[str, str]:
    """The one-GPU baseline on GPU 0 (where there is a GPU); nothing to set on a CPU."""
    return {"CUDA_VISIBLE_DEVICES": "0"} if default_backend() == "nccl" else {}


def run_task(task: str, params: dict[str, Any], tp: int, backend: str, timeout: float) -> dict:
    """Run this script's `task` alone (tp 1, on GPU 0) or as `tp` ranks under mlx.launch;
    rank 0 writes its JSON to a file. Raises with the ranks' last lines when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        argv = [sys.executable, str(TP_GPU), "--rank-task", task,
                "--rank-params", json.dumps({**params, "result": str(result)})]  # fmt: skip
        if tp > 1:
            proc = spawn_command(launched(argv, tp, backend), group=True)
        else:
            proc = spawn_command(argv, env=one_gpu_env(), group=True)
        try:
            code = proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:  # a rank stuck in a collective, or slow
            code = None
        finally:
            proc.stop()
        tail = "".join(proc.log[-30:])
        if code != 0 or not result.exists():
            why = "timed out" if code is None else f"exit {code}"
            raise RuntimeError(f"{task} tp={tp} ({backend}) {why}:\n{tail}")
        return json.loads(result.read_text())
