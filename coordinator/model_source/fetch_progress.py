"""What every worker is fetching from this coordinator: bytes sent against the bytes it
announced, its rate and time left. Read by `wedlm status` and the metrics; written by the
ModelSource handlers (gRPC threads)."""

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

    def begin(self, node_id: str, peer: str, total: int) -> None:
        """A worker announced `total` bytes it is about to fetch."""
        with self._lock:
            self._fetches[node_id or peer] = _Fetch(node_id, peer, total)
        self._export()

    def sent(self, node_id: str, peer: str, nbytes: int) -> None:
        with self._lock:
            fetch = self._fetches.get(node_id or peer)
            if fetch is None:  # a worker that announced nothing: count it anyway
                fetch = self._fetches[node_id or peer] = _Fetch(node_id, peer, 0)
            fetch.done += nbytes
            fetch.total = max(fetch.total, fetch.done)
            fetch.touched = time.monotonic()
            if fetch.done >= fetch.total > 0:
                del self._fetches[node_id or peer]
        if self._metrics is not None:
            self._metrics.fetch_bytes.inc(nbytes)
        self._export()

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
