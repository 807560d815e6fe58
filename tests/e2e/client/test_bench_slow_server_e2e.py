"""`wedlm bench serve` against a server slower than its window (issue 54): a real `wedlm`
process against a tiny OpenAI-compatible HTTP server on 127.0.0.1 that streams its
completions one chunk a second (or sends no headers at all for a minute). The run ends
soon after --duration, says that no request finished inside the window and how long the
cut ones ran, suggests --requests, prints no "None" and writes no empty plot; the server
sees the cut requests' connections close. The same against a slow gRPC coordinator (a
real gRPC server that streams a token a second): its streams are cancelled."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc

WEDLM = [sys.executable, "-m", "wedlm_client.cli", "bench", "serve"]
CHUNKS = 60  # a chunk a second: a completion takes a minute
DURATION_S = 3.0
# the client pool's start (a spawned process importing openai) and the model look-up, on a
# loaded 2-core machine; the run itself adds at most the grace and the unwind
STARTUP_BOUND_S = 25.0


class SlowServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, headers_first: bool) -> None:
        super().__init__(("127.0.0.1", 0), SlowHandler)
        self.headers_first = headers_first  # False: sit on the request before any header
        self.started = 0
        self.left: list[float] = []  # when each completion's client went away
        self.lock = threading.Lock()


class SlowHandler(BaseHTTPRequestHandler):
    server: SlowServer

    def log_message(self, *args) -> None:  # keep the test's output quiet
        pass

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "slow", "object": "model"}]})
        self._send(200, "application/json", body.encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.started += 1
        try:
            if not self.server.headers_first:
                self._wait_for_hangup(float(CHUNKS))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(CHUNKS):
                self.wfile.write(_sse({"text": "a", "index": 0, "finish_reason": None}))
                self.wfile.flush()
                time.sleep(1.0)
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:  # the client cut the request
            self._left()

    def _wait_for_hangup(self, limit: float) -> None:
        """No response at all: wait until the client closes its end (or `limit`)."""
        self.connection.settimeout(limit)
        try:
            if self.connection.recv(1) == b"":
                self._left()
        except OSError:
            pass

    def _left(self) -> None:
        with self.server.lock:
            self.server.left.append(time.monotonic())

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _sse(choice: dict) -> bytes:
    chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "slow",
             "choices": [{**choice, "logprobs": None}]}  # fmt: skip
    return f"data: {json.dumps(chunk)}\n\n".encode()


def slow_server(headers_first: bool) -> Iterator[SlowServer]:
    server = SlowServer(headers_first)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(params=[True, False], ids=["slow-stream", "no-headers"])
def server(request) -> Iterator[SlowServer]:
    yield from slow_server(request.param)


def test_a_server_slower_than_the_window(server: SlowServer, tmp_path: Path):
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    (tmp_path / "serve.png").write_bytes(b"an older run's plot")
    t0 = time.monotonic()
    out = subprocess.run(
        [*WEDLM, "--target", f"slow={url}", "--duration", str(DURATION_S), "--warmup", "0",
         "--rounds", "1", "--concurrency", "2", "--client-processes", "1",
         "--max-tokens", "8", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    assert took < DURATION_S + STARTUP_BOUND_S, (took, out.stderr)
    text = out.stdout + out.stderr
    assert "None" not in text, text
    assert "C=2 slow: no request finished inside the 3 s window" in out.stdout, out.stdout
    assert "2 still running 0.75 s after it were cut, having run 3." in out.stdout
    assert "--requests N measures N requests" in out.stdout
    assert "none finished inside the 3 s window" in out.stderr  # the run's progress line
    assert "requests still running 0.75 s after that are cut" in out.stderr
    if server.headers_first:  # the first tokens came: TTFT is drawn, tok/s says why not
        assert (tmp_path / "serve.png").stat().st_size > 1000
    else:  # nothing at all to draw: neither an empty plot nor the older run's
        assert "no plot: no request finished" in out.stdout
        assert not (tmp_path / "serve.png").exists()

    run = json.loads((tmp_path / "serve.json").read_text())["levels"]["2"]["rounds"][0]["slow"]
    assert (run["sent"], run["ok"], run["failed"], run["unfinished"]) == (2, 0, 0, 2), run
    assert run["requests_ended"] == 0 and run["tok_s"] is None
    assert DURATION_S <= run["unfinished_s_max"] < DURATION_S + 3, run
    if server.headers_first:
        assert run["unfinished_tokens"] >= 2 and run["ttft_ms_p50"] > 0  # tokens did come
    else:
        assert run["unfinished_no_token"] == 2 and run["ttft_ms_p50"] is None
    # the cut requests' connections were closed, not left running on the server
    deadline = time.monotonic() + 10
    while len(server.left) < server.started and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.started == 2 and len(server.left) == 2, (server.started, server.left)


class SlowCoordinator(pb_grpc.CoordinatorServicer):
    """Generate streams a token a second; what the bench asks besides fails (its label
    says so)."""

    def __init__(self) -> None:
        self.started, self.cancelled = 0, 0
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.started += 1
        for _ in range(CHUNKS):
            if not context.is_active():
                break
            yield pb.GenerateEvent(tokens=pb.TokenChunk(ids=[1], text="a"))
            time.sleep(1.0)
        if not context.is_active():
            with self.lock:
                self.cancelled += 1


def test_a_slow_grpc_coordinator_has_its_streams_cancelled(tmp_path: Path):
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(8))
    slow = SlowCoordinator()
    pb_grpc.add_CoordinatorServicer_to_server(slow, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        t0 = time.monotonic()
        out = subprocess.run(
            [*WEDLM, "--target", f"slow=127.0.0.1:{port}", "--duration", str(DURATION_S),
             "--warmup", "0", "--rounds", "1", "--concurrency", "2", "--client-processes", "1",
             "--out", str(tmp_path), "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - t0
        assert out.returncode == 0, out.stderr[-3000:]
        assert took < DURATION_S + STARTUP_BOUND_S, (took, out.stderr)
        result = json.loads(out.stdout)
        run = result["levels"]["2"]["rounds"][0]["slow"]
        assert (run["sent"], run["ok"], run["failed"], run["unfinished"]) == (2, 0, 0, 2), run
        assert run["unfinished_tokens"] >= 2 and run["ttft_ms_p50"] > 0, run
        assert any("no request finished inside the 3 s window" in n for n in result["notes"])
        wait = time.monotonic() + 10
        while slow.cancelled < 2 and time.monotonic() < wait:
            time.sleep(0.2)
        assert (slow.started, slow.cancelled) == (2, 2)  # cancelled, not left running
    finally:
        server.stop(0)
