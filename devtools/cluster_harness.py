"""Start real `wedlm-worker` / `wedlm-coordinator` processes on 127.0.0.1, for the tests and
for the scripts in benchmarks/dev/ (a cluster they time)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

STARTUP_TIMEOUT_S = 120.0


@dataclass
class Proc:
    popen: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)
    log: list[str] = field(default_factory=list)
    group: bool = False  # a session of its own: stop() ends its whole process group

    def expect(self, pattern: str, timeout: float = STARTUP_TIMEOUT_S) -> re.Match:
        """Wait for a stdout line matching pattern (or fail with what the process said)."""
        regex = re.compile(pattern)
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r}; output: {self.log}") from None
            if line is None:
                self.popen.wait(5)
                raise AssertionError(
                    f"process exited ({self.popen.returncode}) before {pattern!r}: "
                    + "".join(self.log[-20:])
                )
            if m := regex.search(line):
                return m

    def wait_exit(self, timeout: float = STARTUP_TIMEOUT_S) -> tuple[int, str]:
        code = self.popen.wait(timeout)
        self._reader.join(5)
        return code, "".join(self.log)

    def stop(self) -> None:
        if self.group:  # a launcher's children (mlx.launch's ranks) outlive it otherwise
            self._signal_group(signal.SIGTERM)
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        if self.group:
            self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # its own session: group id = its pid
            os.killpg(self.popen.pid, sig)


def spawn(module: str, *args: str, env: dict[str, str] | None = None) -> Proc:
    return spawn_command([sys.executable, "-m", module, *args], env=env)


def spawn_command(argv: list[str], env: dict[str, str] | None = None, group: bool = False) -> Proc:
    """Start argv with its stdout and stderr read, line by line, into the Proc. `group`: in a
    session of its own, with a stdin that stays open (mlx.launch polls its stdin: at EOF it
    spins), so that stop() ends it and every process it started."""
    popen = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.PIPE if group else None,
        start_new_session=group,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    proc = Proc(popen, group=group)

    def read() -> None:
        for line in popen.stdout:
            proc.log.append(line)
            proc.lines.put(line)
        proc.lines.put(None)

    proc._reader = threading.Thread(target=read, daemon=True)
    proc._reader.start()
    return proc


def _listening(module: str, *args: str, env: dict[str, str] | None) -> tuple[Proc, str]:
    """A server started and its address, once it says where it listens."""
    proc = spawn(module, *args, env=env)
    return proc, proc.expect(r"listening on (127\.0\.0\.1:\d+)").group(1)


def start_worker(
    model: Path, cluster: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[Proc, str]:
    return _listening(
        "shard_worker.cli",
        "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--cluster", cluster,
        *extra,
        env=env,
    )  # fmt: skip


def start_fetching_worker(
    cluster: str, cache_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[Proc, str]:
    """A worker without a model: it fetches its layers from the coordinator into
    `cache_dir`."""
    return _listening(
        "shard_worker.cli",
        "--cache-dir", str(cache_dir), "--host", "127.0.0.1", "--port", "0",
        "--cluster", cluster, "--no-bonjour", *extra,
        env=env,
    )  # fmt: skip


def gpu_env(index: int, gpus: int, workers: int) -> dict[str, str] | None:
    """Worker `index` on its own GPU: GPUs 1.. when there are more GPUs than workers (GPU 0
    stays with the coordinator), else round robin over all of them; 0 = leave it."""
    if gpus <= 0:
        return None
    gpu = index + 1 if gpus > workers else index % gpus
    return {"CUDA_VISIBLE_DEVICES": str(gpu)}


def start_coordinator(
    model: Path | str, cluster: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[Proc, str]:
    if "--state-dir" not in extra:  # tests keep no jobs unless they say where
        extra = (*extra, "--state-dir", "none")
    return _listening(
        "coordinator.service.server_cli",
        "serve", "--model", str(model), "--port", "0", "--cluster", cluster, *extra,
        env=env,
    )  # fmt: skip


@dataclass
class HttpCoordinator:
    proc: Proc
    address: str  # gRPC, HOST:PORT
    http: str  # the OpenAI API's base URL, http://HOST:PORT/v1

    @property
    def root(self) -> str:
        return self.http.removesuffix("/v1")


@contextmanager
def http_coordinator(
    model: Path | str, *extra: str, env: dict[str, str] | None = None
) -> Iterator[HttpCoordinator]:
    """A coordinator alone (every layer in-process) serving the HTTP API on a free port,
    ready when entered, stopped on exit."""
    proc, address = start_coordinator(
        model, cluster_name(), "--no-bonjour", "--http-port", "0", *extra, env=env
    )
    try:
        http = proc.expect(r"HTTP API on (http://\S+/v1)").group(1)
        proc.expect("serving")
        yield HttpCoordinator(proc, address, http)
    finally:
        proc.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float = 60.0, what: str = "condition", period: float = 0.2):
    """The first truthy value of condition(), polled until `timeout` s."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(period)
    raise AssertionError(f"timed out waiting for {what}")


def engine_outputs(model: Path, jobs) -> list[list[int]]:
    """Greedy reference: each (text, params) job run alone by the single-process engine."""
    from coordinator.engine.local_engine import open_local_engine

    local = open_local_engine(model)
    out = []
    for text, params in jobs:
        seq = local.engine.submit(local.tokenizer.encode(text), params)
        for _ in local.engine.stream([seq]):
            pass
        out.append(seq.output)
    return out


def cluster_name() -> str:
    return f"test-{secrets.token_hex(4)}"


def worker_info(address: str, identity: str):
    """A worker's Info, asked as the coordinator would."""
    import grpc

    from common.call_auth import call_metadata
    from common.proto_gen import wedlm_pb2 as pb
    from common.proto_gen import wedlm_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WorkerStub(channel).Info(
            pb.InfoRequest(),
            metadata=call_metadata(None, "/wedlm.v1.Worker/Info", identity),
            timeout=10,
        )


def worker_kv_sequences(address: str, identity: str) -> int:
    """How many sequences hold KV on a worker (its Info)."""
    return worker_info(address, identity).kv_sequences
