"""The heartbeat outlives any one pipeline: a re-plan closes the old pipeline's channels
while a heartbeat call may be in flight ("Cannot invoke RPC on closed channel!"), and the
thread must go on beating the next pipeline, or a worker killed while the coordinator is
idle is never noticed (the console's lost-worker test found it dead)."""

from __future__ import annotations

import threading

import pytest

from coordinator.cluster.heartbeat import Heartbeat
from coordinator.cluster.worker_link import WorkerCallError, WorkerLink
from tests.support.cluster_harness import free_port, wait_until


class Holder:
    """What the heartbeat reads of a pipeline: its worker links, whether it broke."""

    def __init__(self, links: list[WorkerLink]) -> None:
        self.links, self.broken = links, None
        self.aborted = threading.Event()

    def abort(self, error: Exception) -> None:
        self.broken = error
        self.aborted.set()


def test_a_closed_channel_does_not_end_the_heartbeat():
    closed = WorkerLink(f"127.0.0.1:{free_port()}", None, "m")
    closed.channel.close()  # as a re-plan's old.close() leaves it
    with pytest.raises(ValueError, match="closed channel"):  # what used to end the thread
        closed.info(timeout=0.5)
    nobody = WorkerLink(f"127.0.0.1:{free_port()}", None, "m")  # no server: UNAVAILABLE
    old, new = Holder([closed]), Holder([nobody])
    current = [old]
    beat = Heartbeat(lambda: current[0], period_s=0.05, timeout_s=0.3, misses=2)
    beat.start()
    try:
        wait_until(lambda: beat.is_alive() and not old.aborted.is_set(), timeout=2)
        current[0] = new  # the re-planned pipeline, whose worker is gone
        assert new.aborted.wait(10), "the heartbeat stopped after the closed channel"
        assert isinstance(new.broken, WorkerCallError)
        assert beat.is_alive()
    finally:
        beat.stop()
        beat.join(5)
        nobody.channel.close()
