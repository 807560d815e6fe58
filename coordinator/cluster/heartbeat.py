"""Heartbeats: an Info call to every pipeline worker each second. A worker that misses
`misses` in a row (a hung or suspended process keeps its TCP connection open, so only a
deadline notices) breaks the pipeline, which makes the engine recover."""

from __future__ import annotations

import logging
import threading

import grpc

from coordinator.cluster.worker_link import WorkerCallError

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    def __init__(
        self, get_pipeline, period_s: float = 1.0, timeout_s: float = 1.5, misses: int = 2
    ):
        super().__init__(name="heartbeat", daemon=True)
        self.get_pipeline = get_pipeline  # the current StagePipeline with workers, or None
        self.period_s, self.timeout_s, self.misses = period_s, timeout_s, misses
        self._missed: dict[str, int] = {}
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        while not self._stopping.wait(self.period_s):
            try:
                self._beat()
            except Exception as e:  # a re-plan closed the channel mid-call: beat the next one
                # (the thread must outlive any one pipeline: a dead heartbeat never notices
                # a worker killed while the coordinator is idle)
                log.debug("heartbeat skipped: %s", e)

    def _beat(self) -> None:
        """One Info call to each worker of the current pipeline."""
        pipeline = self.get_pipeline()
        if pipeline is None or getattr(pipeline, "broken", None) is not None:
            return
        for link in pipeline.links:
            try:
                link.latest_info = link.info(timeout=self.timeout_s)
                self._missed[link.address] = 0
            except WorkerCallError as e:
                n = self._missed.get(link.address, 0) + 1
                self._missed[link.address] = n
                log.warning("heartbeat %d/%d to %s failed: %s", n, self.misses, link.address, e)
                if n >= self.misses:
                    self._missed[link.address] = 0
                    pipeline.abort(
                        WorkerCallError(
                            link.address, grpc.StatusCode.UNAVAILABLE, "missed heartbeats"
                        )
                    )
                    break
