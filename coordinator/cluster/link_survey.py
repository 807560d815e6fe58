"""`--tp auto`'s measurements: every candidate member's memory read bandwidth (each worker
measures its own once per process; the coordinator its own) and the link of every pair of
candidate group members (the coordinator times its own links to workers over their Echo;
a worker times its link to another worker when asked, ProbeLink). One round per plan, each
probe bounded in time; a re-plan reuses a pair's figures younger than `max_age_s`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from common import link_probe
from common.proto_gen import wedlm_pb2 as pb
from common.read_bandwidth import read_bandwidth
from coordinator.cluster.tp_choice import Figures
from coordinator.cluster.worker_link import WorkerCallError

log = logging.getLogger(__name__)
MAX_AGE_S = 600.0
BUDGET_S = 20.0  # the whole survey's bound: pairs left when it runs out go unmeasured


class LinkSurvey:
    def __init__(
        self,
        timeout_s: float = link_probe.DEFAULT_TIMEOUT_S,
        max_age_s: float = MAX_AGE_S,
        budget_s: float = BUDGET_S,
        local_read: Callable[[], float] = read_bandwidth,
    ) -> None:
        self.timeout_s = timeout_s  # per probe
        self.max_age_s = max_age_s
        self.budget_s = budget_s
        self.local_read = local_read  # the coordinator's own (on the thread that owns MLX)
        self._links: dict[frozenset, tuple[float, pb.LinkFigures]] = {}
        self.last = Figures()  # the figures of the latest plan (`wedlm status`)

    def measure(self, members: list, pairs: list) -> Figures:
        """The read bandwidth of `members` (WorkerEntry; the coordinator's has source
        "local") and the links of `pairs` of them."""
        start = time.monotonic()
        figures = Figures()
        workers = [m for m in members if m.source != "local"]
        with ThreadPoolExecutor(max(1, min(len(workers), 16))) as pool:
            reads = {m.address: pool.submit(self._read, m) for m in workers}
            for m in members:  # the coordinator's, meanwhile
                if m.source == "local":
                    figures.reads[m.address] = self.local_read()
            figures.reads.update({name: f.result() for name, f in reads.items()})
        for a, b in pairs:  # one at a time: concurrent probes would share the links
            key = frozenset((a.address, b.address))
            if time.monotonic() - start > self.budget_s:
                why = f"the survey's {self.budget_s:g} s ran out"
                figures.links[key] = pb.LinkFigures(a=a.address, b=b.address, error=why)
                continue
            figures.links[key] = self._link(a, b)
        self.last = figures
        log.info(
            "measured how fast %d members read memory and %d links between them carry data "
            "(to choose between a pipeline and tensor parallelism) in %.2f s",
            len(members), len(pairs), time.monotonic() - start,
        )  # fmt: skip
        return figures

    def _read(self, member) -> float:
        if member.info.read_bandwidth > 0:
            return member.info.read_bandwidth
        try:
            return member.link.probe_link("", self.timeout_s).read_bandwidth
        except WorkerCallError as e:
            log.warning("no read bandwidth from %s: %s", member.address, e)
            return 0.0

    def _link(self, a, b) -> pb.LinkFigures:
        key = frozenset((a.address, b.address))
        kept = self._links.get(key)
        if kept is not None and time.monotonic() - kept[0] < self.max_age_s:
            return kept[1]
        if "local" in (a.source, b.source):
            worker = b if a.source == "local" else a
            local = a if worker is b else b
            figures = link_probe.measure(
                worker.link.echo, local.address, worker.address, self.timeout_s
            )
        else:
            try:
                figures = a.link.probe_link(b.address, self.timeout_s).link
            except WorkerCallError as e:
                figures = pb.LinkFigures(error=str(e))
            figures.a, figures.b = a.address, b.address
        if figures.error:
            log.warning("link %s↔%s: %s", a.address, b.address, figures.error)
        else:
            self._links[key] = (time.monotonic(), figures)
        return figures
