"""Handing a hidden state from one stage to the next (issue 31, "Between stages"): over an
mx.distributed backend's send/recv (`ring` here; jaccl has them too, MLX's NCCL backend
does not) against our gRPC relay hop. benchmarks/dev/tp_costs.py's `handoff` phase runs it.

- ring: two real processes joined by `ring` on 127.0.0.1 pass the array back and forth
  (rank 0 sends, rank 1 receives and sends it back); one handoff = the round trip / 2.
- gRPC: this process and a real gRPC server process (`python -m benchmarks.dev.tp_handoff
  serve`) on 127.0.0.1, one bidirectional stream, as a worker relays: the sender frames the
  array by hand into a ForwardRequest (common/tensor_codec.py, common/wire_frames.py), the
  receiver parses it without copying the tensor in a gRPC thread, hands it to its one MLX
  thread through a queue, decodes it into an MLX array, evaluates it, and frames it back
  the same way; one hop = the round trip / 2.

Both sides start and end with an evaluated MLX array, so each figure is the whole handoff.
"""

from __future__ import annotations

import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script

from common.proto_gen import wedlm_pb2 as pb
from common.tensor_codec import decode, encode_frame
from common.wire_frames import framed_parser, serialize, with_tensor

ROOT = Path(__file__).resolve().parents[2]
METHOD = "/handoff.Hop/Stream"
OPTIONS = [("grpc.max_send_message_length", 1 << 28), ("grpc.max_receive_message_length", 1 << 28)]
# name -> [B, T, hidden] of a ForwardRequest's hidden states, bf16
MESSAGES = {
    "decode 1 x 4096": (1, 1, 4096),
    "decode 1 x 5120": (1, 1, 5120),
    "prefill 512 x 4096": (1, 512, 4096),
}


def _hidden(shape: tuple[int, ...]):
    import mlx.core as mx

    x = (mx.random.normal(shape) * 0.5).astype(mx.bfloat16)
    mx.eval(x)
    return x


def _stats(times: list[float], warmup: int) -> dict[str, float]:
    kept = sorted(times[warmup:])
    return {"ms": round(statistics.median(kept) / 2 * 1e3, 4),
            "p90_ms": round(kept[int(0.9 * (len(kept) - 1))] / 2 * 1e3, 4)}  # fmt: skip


# ---------------------------------------------------------------- mx.distributed send/recv


def rank_handoff(group, p: dict[str, Any]) -> dict[str, Any]:
    """One rank of the ring ping-pong (run by tp_costs.py's run_ring); rank 0's result."""
    import mlx.core as mx

    dist, out = mx.distributed, {}
    for name, shape in MESSAGES.items():
        if name not in p["messages"]:
            continue
        x = _hidden(tuple(shape))
        mx.eval(dist.all_sum(mx.array(1.0), group=group))  # both ranks at the start line
        times = []
        for _ in range(p["warmup"] + p["repeats"]):
            t0 = time.perf_counter()
            if group.rank() == 0:
                mx.eval(dist.send(x, 1, group=group))
                y = dist.recv_like(x, 1, group=group)
                mx.eval(y)
            else:
                y = dist.recv_like(x, 0, group=group)
                mx.eval(y)
                mx.eval(dist.send(y, 0, group=group))
            times.append(time.perf_counter() - t0)
        intact = bool(mx.array_equal(x, y).item())  # rank 0: what came back is what went
        out[name] = {"bytes": int(x.nbytes), "intact": intact, **_stats(times, p["warmup"])}
    return out


# ---------------------------------------------------------------- the gRPC relay hop


def _framed(x) -> bytes:
    return with_tensor(pb.ForwardRequest(batch_id=1, plan_epoch=1), "hidden", encode_frame(x))


def serve() -> None:
    """A receiving stage: parse in the gRPC thread, decode and answer in one MLX thread."""
    import mlx.core as mx

    work: queue.SimpleQueue = queue.SimpleQueue()

    def mlx_thread() -> None:
        while True:
            request, replies = work.get()
            x = decode(request.hidden)
            mx.eval(x)
            replies.put(_framed(x))

    def stream(requests, context):
        replies: queue.SimpleQueue = queue.SimpleQueue()

        def feed() -> None:
            try:
                for request in requests:
                    work.put((request, replies))
            except grpc.RpcError:
                pass  # the client closed its channel: the benchmark is over
            replies.put(None)

        threading.Thread(target=feed, daemon=True).start()
        yield from iter(replies.get, None)

    threading.Thread(target=mlx_thread, daemon=True).start()
    parse = framed_parser(pb.ForwardRequest, "hidden")
    handler = grpc.method_handlers_generic_handler(
        "handoff.Hop", {"Stream": grpc.stream_stream_rpc_method_handler(stream, parse, serialize)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"hop on 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def grpc_handoff(p: dict[str, Any]) -> dict[str, Any]:
    """The same messages through a real gRPC server process, framed as a worker frames them."""
    import mlx.core as mx

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.dev.tp_handoff", "serve"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        if not line.startswith("hop on "):
            raise RuntimeError(f"the hop server did not start: {line!r}")
        channel = grpc.insecure_channel(line.split()[-1], options=OPTIONS)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        parse = framed_parser(pb.ForwardRequest, "hidden")
        call = channel.stream_stream(
            METHOD, request_serializer=serialize, response_deserializer=parse
        )
        replies = call(iter(outbox.get, None))
        out = {}
        for name, shape in MESSAGES.items():
            if name not in p["messages"]:
                continue
            x, times = _hidden(tuple(shape)), []
            for _ in range(p["warmup"] + p["repeats"]):
                t0 = time.perf_counter()
                outbox.put(_framed(x))
                y = decode(next(replies).hidden)
                mx.eval(y)
                times.append(time.perf_counter() - t0)
            intact = bool(mx.array_equal(x, y).item())
            out[name] = {"bytes": int(x.nbytes), "intact": intact, **_stats(times, p["warmup"])}
        outbox.put(None)
        channel.close()
        return out
    finally:
        proc.kill()
        proc.wait()


def compare(ring: dict[str, Any], relay: dict[str, Any]) -> dict[str, Any]:
    """Per message: both handoffs and which is faster (by how much)."""
    rows = []
    for name, r in ring.items():
        g = relay[name]
        faster = "ring send/recv" if r["ms"] < g["ms"] else "gRPC relay"
        rows.append({"message": name, "bytes": r["bytes"], "ring_ms": r["ms"],
                     "ring_p90_ms": r["p90_ms"], "grpc_ms": g["ms"], "grpc_p90_ms": g["p90_ms"],
                     "faster": faster, "intact": r["intact"] and g["intact"],
                     "grpc_over_ring": round(g["ms"] / r["ms"], 2)})  # fmt: skip
    return {"rows": rows, "measured": "2 processes on 127.0.0.1, this host; one-way (RTT / 2)"}


def plot(result: dict, path: Path) -> None:
    from benchmarks.dev.bench_io import pyplot

    plt = pyplot()
    if plt is None or "handoff" not in result:
        return
    rows = result["handoff"]["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["ring_ms"] for r in rows], 0.4, label="ring send/recv")
    ax.bar([x + 0.2 for x in xs], [r["grpc_ms"] for r in rows], 0.4, label="gRPC relay hop")
    ax.set_xticks(list(xs), [r["message"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms per handoff (median, one way)")
    ax.legend()
    fig.suptitle("A hidden state between two stages, bf16, 127.0.0.1")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
