"""What a new user sees in the first ten minutes (issue 54), with real processes on
127.0.0.1: a coordinator holding layers 0-1 (gRPC and HTTP ports) and a worker without a
model that fetches layers 2-3 from it.

- `wedlm status`: memory as used/total (as the web console shows it), the coordinator as a
  row with its layers, each device's name whole;
- a `wedlm` cluster command pointed at the HTTP port names the gRPC port (any web server:
  asks whether this is the gRPC port), exits 1, and shows no raw HTTP/2 parse error;
- the worker's terminal follows its state: unassigned, assigned, fetching, fetched,
  serving, and (the coordinator stopped) coordinator lost."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.cluster_harness import (
    Proc,
    cluster_name,
    start_coordinator,
    start_fetching_worker,
    wait_until,
)

SECRET = "first-ten-minutes"
WEDLM = [sys.executable, "-m", "wedlm_client.cli"]


def wedlm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*WEDLM, *args], capture_output=True, text=True, timeout=90)


@pytest.fixture(scope="module")
def cluster(checkpoint_dir, tmp_path_factory) -> Iterator[dict]:
    model = checkpoint_dir("wedlm_qwen2", seed=54, num_hidden_layers=4)
    name, env = cluster_name(), {"WEDLM_SECRET": SECRET}
    cache = tmp_path_factory.mktemp("layers")
    worker, worker_address = start_fetching_worker(name, cache, env=env)
    coord = None
    try:
        coord, address = start_coordinator(
            model, name, "--no-bonjour", "--worker", worker_address, "--expect", "1",
            "--layers", "0-1", "--http-port", "0", "--secret", SECRET,
        )  # fmt: skip
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        coord.expect("serving")
        yield {"address": address, "http": http, "worker": worker, "coord": coord,
               "worker_address": worker_address}  # fmt: skip
    finally:
        for p in (coord, worker):
            if p is not None:
                p.stop()


# the worker's lines from its start to serving, in this order
STATES = (
    r"listening on \S+ layers unassigned \(model from the coordinator\)",
    r": assigned layers 2-3 by the coordinator at 127\.0\.0\.1:\d+$",
    r": fetching layers 2-3 of model \S+ from 127\.0\.0\.1:\d+: [\d.]+ MB in 2 files$",
    r": fetched layers 2-3 of model \S+: [\d.]+ MB in [\d.]+ s",
    r": serving layers 2-3 of model \S+ \(plan \d+, the last stage\)$",
)


def worker_lines(worker: Proc) -> list[str]:
    return [line.rstrip("\n") for line in worker.log]


def test_the_worker_terminal_follows_its_state(cluster):
    worker = cluster["worker"]
    serving = wait_until(
        lambda: [line for line in worker_lines(worker) if ": serving layers" in line],
        30, "the worker's serving line",
    )  # fmt: skip
    lines = worker_lines(worker)
    states = [
        next(i for i, line in enumerate(lines) if re.search(pattern, line)) for pattern in STATES
    ]
    assert states == sorted(states), lines  # in this order
    print("\n".join(lines))  # what the user sees (pytest -s)
    assert len(serving) == 1, lines  # one line per change, not one per heartbeat
    assert len(set(lines)) == len(lines), lines


def test_status_shows_used_memory_and_the_coordinator_as_a_member(cluster):
    out = wedlm("status", "--cluster", cluster["address"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    status = json.loads(wedlm("status", "--cluster", cluster["address"], "--json").stdout)
    me, (w,) = status["coordinator"], status["workers"]
    header = next(line for line in lines if line.startswith("member"))
    assert "mem used/total GiB" in header, header
    rows = lines[lines.index(header) + 1 :]
    coord_row = rows[0].split()
    assert coord_row[:4] == ["coordinator", me["address"], "0-1", "serving"], rows
    worker_row = rows[1].split()
    assert worker_row[:3] == [cluster["worker_address"], "2-3", "serving"], rows
    for row, member in ((rows[0], me), (rows[1], w["info"])):
        assert row.endswith(member["device"]), (row, member)  # whole, however long
        used, total = (float(x) for x in re.search(r"(\d+\.\d)/(\d+\.\d)", row).groups())
        assert total == round(int(member["memory_total"]) / 2**30, 1)
        assert 0 < used < total  # used, not available: this process alone uses some
    assert me["device"] and int(me["memory_total"]) > int(me["memory_available"]) > 0


def test_a_cluster_command_at_the_http_port_names_the_grpc_port(cluster):
    http_address = cluster["http"].removeprefix("http://").removesuffix("/v1")
    grpc_port = cluster["address"].rpartition(":")[2]
    hint = f"the gRPC port is 127.0.0.1:{grpc_port} (try --cluster 127.0.0.1:{grpc_port})"
    for command in (
        ["status", "--cluster", http_address],
        ["generate", "--cluster", http_address, "--prompt", "hi", "--max-tokens", "2"],
        ["job", "some-id", "--cluster", http_address],
    ):
        out = wedlm(*command)
        assert out.returncode == 1, (command, out.stdout, out.stderr)
        assert f"{http_address} is the coordinator's HTTP port, not its gRPC port" in out.stderr
        assert hint in out.stderr, out.stderr
        assert "Failed parsing HTTP/2" not in out.stderr + out.stdout


class _Plain(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_any_http_server_gets_the_question(tmp_path: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Plain)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = wedlm("status", "--cluster", f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 1
    assert "answers HTTP, not gRPC: this looks like an HTTP port" in out.stderr, out.stderr
    assert "is this the coordinator's gRPC port? (default 50051" in out.stderr
    assert "Failed parsing HTTP/2" not in out.stderr


def test_the_worker_terminal_says_when_the_coordinator_is_lost(cluster):
    """Last in this file: it stops the coordinator."""
    cluster["coord"].stop()
    worker = cluster["worker"]
    lost = wait_until(
        lambda: [line for line in worker_lines(worker) if ": coordinator lost: " in line],
        30, "the worker's coordinator-lost line",
    )  # fmt: skip
    assert "no call from it for 10 s" in lost[0] and "layers 2-3 of model" in lost[0], lost
    assert len(lost) == 1
