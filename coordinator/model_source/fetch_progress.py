"""What every worker is fetching from this coordinator: the bytes it reports received
against the bytes it announced, its rate and time left. Read by `wedlm status` and the
metrics; written by the ModelSource handlers (gRPC threads)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from common.proto_gen import wedlm_pb2 as pb

IDLE_S = 60.0  # a fetch silent this long is over (the worker went away or finished)


@dataclass
class _Fetch:
    node_id: str
    peer: str
    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    touched: float = field(default_factory=time.monotonic)


class FetchProgress:
    def __init__(self, metrics=None) -> None:
        self._fetches: dict[str, _Fetch] = {}
        self._lock = threading.Lock()
        self._metrics = metrics

    def report(self, node_id: str, peer: str, total: int, received: int) -> None:
        """A worker's report: `received` of the `total` bytes it fetches (the truth; the
        bytes this side sent run ahead by what gRPC's flow control lets it buffer)."""
        key = node_id or peer
        with self._lock:
            fetch = self._fetches.get(key)
            if fetch is None or received < fetch.done:  # a new fetch
                fetch = self._fetches[key] = _Fetch(node_id, peer, total)
            fetch.total, fetch.done = total, min(received, total)
            fetch.touched = time.monotonic()
            if fetch.done >= fetch.total:
                del self._fetches[key]
        self._export()

    def sent(self, nbytes: int) -> None:
        if self._metrics is not None:
            self._metrics.fetch_bytes.inc(nbytes)

    def snapshot(self) -> list[pb.LayerFetch]:
        now = time.monotonic()
        out = []
        with self._lock:
            for key, f in list(self._fetches.items()):
                if now - f.touched > IDLE_S:
                    del self._fetches[key]
                    continue
                elapsed = max(now - f.started, 1e-6)
                rate = f.done / elapsed
                eta = (f.total - f.done) / rate if rate > 0 else -1.0
                out.append(
                    pb.LayerFetch(
                        node_id=f.node_id, peer=f.peer, bytes_done=f.done,
                        bytes_total=f.total, bytes_per_s=rate, eta_s=eta,
                    )
                )  # fmt: skip
        return out

    def _export(self) -> None:
        if self._metrics is None:
            return
        with self._lock:
            fetches = list(self._fetches.values())
        self._metrics.fetches_active.set(len(fetches))
        self._metrics.fetch_remaining.set(sum(f.total - f.done for f in fetches))
