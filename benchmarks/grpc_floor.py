"""The transport floor under a hop: a bidirectional gRPC stream that echoes raw bytes
between two Python processes (grpcio's synchronous API, the one the worker and the
coordinator use), with no protobuf message, no MLX and no worker thread. benchmarks/
cluster.py reports it next to the real hop so that the hop's own overhead can be told
apart from what grpcio costs on the machine.

  python -m benchmarks.grpc_floor serve PORT      # the echo server (cluster.py starts it)
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = [("grpc.max_send_message_length", 1 << 28), ("grpc.max_receive_message_length", 1 << 28)]


def _same(data: bytes) -> bytes:
    return data


def serve(port: int) -> None:
    def echo(requests, context):
        yield from requests

    handler = grpc.method_handlers_generic_handler(
        "floor.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo, _same, _same)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"echo on 127.0.0.1:{bound}", flush=True)
    server.wait_for_termination()


def measure(payloads: list[int], repeats: int, warmup: int = 20) -> dict[str, float]:
    """Median round trip (ms) of each payload size through a fresh echo process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.grpc_floor", "serve", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("echo on "):
            raise RuntimeError(f"the echo server did not start: {line!r}")
        channel = grpc.insecure_channel(line.split()[-1], options=OPTIONS)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        stream = channel.stream_stream(
            "/floor.Echo/Stream", request_serializer=_same, response_deserializer=_same
        )
        replies = stream(iter(outbox.get, None))
        out = {}
        for size in payloads:
            data, times = os.urandom(size), []
            for _ in range(warmup + repeats):
                start = time.perf_counter()
                outbox.put(data)
                next(replies)
                times.append(time.perf_counter() - start)
            out[str(size)] = statistics.median(times[warmup:]) * 1e3
        outbox.put(None)
        channel.close()
        return out
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[2]))
    else:
        print(measure([16384, 262144, 4194304], 200))
