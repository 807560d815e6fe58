"""One link's figures for `--tp auto`: the round trip of an empty message and the bandwidth
between a 256 KiB and a 4 MiB one, timed from the sender over the receiver's Echo (which
answers with a length only, so each figure is one way's payload). The coordinator probes its
own links this way; a worker probes its link to a peer for the coordinator (ProbeLink)."""

from __future__ import annotations

import time
from collections.abc import Callable

from common.proto_gen import wedlm_pb2 as pb

SMALL = 256 << 10
LARGE = 4 << 20
MAX_ECHO = 8 << 20  # what an Echo accepts
DEFAULT_TIMEOUT_S = 2.0
MAX_TIMEOUT_S = 30.0
ROUNDS = 3  # the best of this many sends of each size (the first one warms the channel)

# (payload, timeout_s) -> None; raises on failure (the caller reports the reason)
Echo = Callable[[bytes, float], None]


def _best(echo: Echo, payload: bytes, deadline: float) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the probe ran out of time")
        start = time.perf_counter()
        echo(payload, left)
        best = min(best, time.perf_counter() - start)
    return best


def measure(echo: Echo, a: str, b: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> pb.LinkFigures:
    """The figures of the link a -> b through `echo`, all sends within `timeout_s`; a
    failure or a timeout is the figures' `error`."""
    deadline = time.monotonic() + timeout_s
    try:
        rtt = _best(echo, b"", deadline)
        small = _best(echo, bytes(SMALL), deadline)
        large = _best(echo, bytes(LARGE), deadline)
    except Exception as e:  # an RPC error, a timeout: the link is unusable for a group
        return pb.LinkFigures(a=a, b=b, error=f"{type(e).__name__}: {e}"[:300])
    # The slope between the sizes is the link's rate; noise that inverts them falls back
    # on the large message's whole time.
    spread = large - small
    bandwidth = (LARGE - SMALL) / spread if spread > 0 else LARGE / large
    return pb.LinkFigures(a=a, b=b, rtt_s=rtt, bandwidth=bandwidth, small_s=small, large_s=large)


def describe(link: pb.LinkFigures) -> str:
    """`127.0.0.1:5001↔127.0.0.1:5002 0.31 ms RTT, 1.2 GB/s`"""
    pair = f"{link.a}↔{link.b}"
    if link.error:
        return f"{pair} not measured: {link.error}"
    return f"{pair} {link.rtt_s * 1e3:.2f} ms RTT, {link.bandwidth / 1e9:.2f} GB/s"
