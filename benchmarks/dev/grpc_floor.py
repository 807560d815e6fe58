"""The transport floor under a hop: a bidirectional gRPC stream that echoes raw bytes
between two Python processes (grpcio's synchronous API, the one the worker and the
coordinator use), with no protobuf message, no MLX and no worker thread. benchmarks/
cluster.py reports it next to the real hop so that the hop's own overhead can be told
apart from what grpcio costs on the machine.

  python -m benchmarks.dev.grpc_floor serve PORT      # the echo server (cluster.py starts it)
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
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
        [sys.executable, "-m", "benchmarks.dev.grpc_floor", "serve", "0"],
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


# ---- the relay floor -------------------------------------------------------------------------
def _start(server: grpc.Server, port: int, what: str) -> None:
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"{what} on 127.0.0.1:{bound}", flush=True)
    server.wait_for_termination()


def serve_sink(port: int) -> None:
    """Stream: echoes the client's messages, and puts out whatever Relay calls bring."""
    out: queue.SimpleQueue = queue.SimpleQueue()
    done = object()

    def stream(requests, context):
        def take() -> None:
            try:
                for r in requests:
                    out.put(r)
            except grpc.RpcError:  # the client went away
                pass
            out.put(done)

        threading.Thread(target=take, daemon=True).start()
        while (item := out.get()) is not done:
            yield item

    def relay(requests, context):
        for r in requests:
            out.put(r)
        return b""

    handler = grpc.method_handlers_generic_handler(
        "floor.Echo",
        {
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same),
            "Relay": grpc.stream_unary_rpc_method_handler(relay, _same, _same),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    _start(server, port, "sink")


def serve_forward(port: int, next_address: str) -> None:
    """Stream: relays every message the client sends to `next_address`'s Relay call, over
    one long-lived stream written by gRPC's own thread; answers nothing."""
    channel = grpc.insecure_channel(next_address, options=OPTIONS)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    relay = channel.stream_unary("/floor.Echo/Relay", request_serializer=_same,
                                 response_deserializer=_same)  # fmt: skip
    call = relay.future(iter(outbox.get, None))  # kept: a dropped future cancels its call

    def stream(requests, context):
        for r in requests:
            outbox.put(r)
        yield from ()

    handler = grpc.method_handlers_generic_handler(
        "floor.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    _start(server, port, "forward")
    call.cancel()


def _process(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.dev.grpc_floor", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if " on 127.0.0.1:" not in line:
        proc.kill()
        raise RuntimeError(f"the {args[0]} process did not start: {line!r}")
    return proc, line.split()[-1]


def measure_relay(payloads: list[int], repeats: int, warmup: int = 20) -> dict[str, dict]:
    """Per payload size (ms, medians): `echo` (A: client → sink → client), `chain`
    (B: client → forward → sink → client) and `hop` (the median of B − A over the pairs)."""
    procs: list[subprocess.Popen] = []
    channels: list[grpc.Channel] = []
    try:
        sink, sink_address = _process("sink", "0")
        procs.append(sink)
        forward, forward_address = _process("forward", "0", sink_address)
        procs.append(forward)
        streams = []
        for address in (sink_address, forward_address):
            channel = grpc.insecure_channel(address, options=OPTIONS)
            channels.append(channel)
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            call = channel.stream_stream("/floor.Echo/Stream", request_serializer=_same,
                                         response_deserializer=_same)  # fmt: skip
            streams.append((outbox, call(iter(outbox.get, None))))
        (to_sink, replies), (to_forward, _) = streams
        out = {}
        for size in payloads:
            data = os.urandom(size)
            a, b = [], []
            for _ in range(warmup + repeats):
                for inbox, times in ((to_sink, a), (to_forward, b)):
                    start = time.perf_counter()
                    inbox.put(data)
                    got = next(replies)
                    times.append(time.perf_counter() - start)
                    assert len(got) == size
            a, b = a[warmup:], b[warmup:]
            out[str(size)] = {
                "echo": statistics.median(a) * 1e3,
                "chain": statistics.median(b) * 1e3,
                "hop": statistics.median(y - x for x, y in zip(a, b, strict=True)) * 1e3,
                "repeats": repeats,
            }
        for outbox, _ in streams:
            outbox.put(None)
        return out
    finally:
        for channel in channels:
            channel.close()
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["sink"]:
        serve_sink(int(sys.argv[2]))
    elif sys.argv[1:2] == ["forward"]:
        serve_forward(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["relay"]:
        print(measure_relay([16384, 262144, 4194304], 200))
    else:
        print(measure([16384, 262144, 4194304], 200))
