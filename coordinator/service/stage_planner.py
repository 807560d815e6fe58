"""Plans the pipeline the engine runs on: the coordinator's own layers first, then the
workers that answer, each told its successor. Every plan has a new epoch; a plan is made at
start-up, after a loss (recovery) and when a worker joins (the same path: the engine then
re-prefills every live sequence on the new pipeline). `build` runs on the thread that owns
MLX, since it may load the coordinator's layers; `joiners` only probes over gRPC."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from common.errors import WedlmError
from common.free_port import free_port
from common.kv_format import FULL, KVFormat
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.tensor_group.member import GroupMember
from common.tensor_group.rdma import rdma_ports
from common.tensor_group.spec import GroupSpec, available_backends
from coordinator.cluster.cluster_setup import (
    LOCAL,
    Assembly,
    LocalMember,
    assemble,
    plan_stages,
    prefetch,
    probe_all,
)
from coordinator.cluster.discovery import (
    DiscoveredWorker,
    WorkerBrowser,
    merge_candidates,
    parse_static,
)
from coordinator.cluster.link_survey import LinkSurvey
from coordinator.cluster.worker_chain import WorkerChain
from coordinator.engine.local_layers import LocalLayers
from coordinator.engine.pipeline import StagePipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanSettings:
    cluster: str
    secret: str | None
    static: list[str]
    kv_reserve_tokens: int
    micro_batches: int  # 0: one per stage (and one more for a coordinator-led group)
    tls: object = None
    model_source: str = ""  # where workers fetch layers they lack (AssignRequest.model_source)
    kv: KVFormat = FULL  # how every stage stores KV (--kv-bits)
    tp: int | str = 1  # tensor-parallel group size (--tp; 1: a pipeline; "auto": measured)


class StagePlanner:
    def __init__(
        self,
        settings: PlanSettings,
        config: ModelConfig,
        local: LocalLayers | None,
        browser: WorkerBrowser | None,
    ) -> None:
        self.settings = settings
        self.config = config
        self.local = local  # None: --no-local-layers
        self.browser = browser
        self.assembly: Assembly | None = None
        self.survey = LinkSurvey()  # --tp auto's figures, kept across re-plans
        self.epoch = 0
        self._lock = threading.Lock()
        self._rdma: tuple | None = None  # its RDMA ports, read once (system_profiler is slow)

    def candidates(self) -> list[DiscoveredWorker]:
        """Listed workers first (in their order), then those found over Bonjour."""
        found = self.browser.workers() if self.browser is not None else []
        return merge_candidates(parse_static(self.settings.static), found)

    def _local_member(self) -> LocalMember | None:
        if self.local is None:
            return None
        if self.settings.tp == 1:
            return LocalMember(self.local.available_bytes(), self.local.fixed)
        # a candidate for rank 0 of the first tensor group, on a port free now
        if self._rdma is None:
            self._rdma = tuple(rdma_ports())
        backends = tuple(available_backends(list(self._rdma)))
        return LocalMember(
            self.local.available_bytes(), self.local.fixed, free_port(""), backends, self._rdma
        )

    def _start_local(self, layer_range: LayerRange, spec: GroupSpec) -> GroupMember:
        """The coordinator's group process for rank 0 of `spec` over `layer_range` (raises
        GroupFailed when the group does not form)."""
        return GroupMember(self.config.path, layer_range, self.settings.kv, spec)

    def build(self, probe_timeout_s: float = 2.0) -> tuple[StagePipeline, int]:
        """Probe, plan, assign, route and load: the new pipeline and its micro-batch count.
        Raises PlanError / WorkerCallError / WedlmError when no pipeline can be made now."""
        with self._lock:
            self.epoch += 1
            epoch = self.epoch
        s = self.settings
        assembly = assemble(
            self.candidates(),
            self.config,
            s.secret,
            s.cluster,
            s.kv_reserve_tokens,
            probe_timeout_s=probe_timeout_s,
            tls=s.tls,
            local=self._local_member(),
            epoch=epoch,
            model_source=s.model_source,
            kv=s.kv,
            tp=s.tp,
            start_local=self._start_local if self.local is not None else None,
            survey=self.survey,
        )
        runner = (
            self.local.hold(assembly.local, assembly.local_member)
            if self.local is not None
            else None
        )
        links = assembly.links
        chain = WorkerChain(links, epoch) if links else None
        if runner is None and chain is None:
            raise WedlmError("the plan holds no layers")  # plan_stages never returns one
        pipeline = StagePipeline(runner, chain)
        old, self.assembly = self.assembly, assembly
        if old is not None:  # links of the previous plan that the new one does not use
            used = {id(link) for link in links}
            for e in old.entries:
                if e.link is not None and id(e.link) not in used:
                    e.link.close()
        for e in assembly.entries:  # probe links of workers outside the plan
            if e.layers is None and e.link is not None:
                e.link.close()
        log.info("plan %d: %s", epoch, assembly.layout())
        return pipeline, s.micro_batches or pipeline.default_micro_batches

    def joiners(self, probe_timeout_s: float = 1.0) -> list[str]:
        """Workers that answer now and would change the plan (a new worker, or one that
        came back): the engine should re-plan to take them in. Only probes; no MLX."""
        current = self.assembly
        if current is None:
            return []
        known = {e.address for e in current.entries if e.health in ("serving", "spare")}
        fresh = [c for c in self.candidates() if c.address not in known]
        if not fresh:
            return []
        s = self.settings
        probed = probe_all(fresh, self.config, s.secret, s.cluster, probe_timeout_s, s.tls)
        try:
            return self._joining(current, probed)
        finally:
            for e in probed:
                if e.link is not None:
                    e.link.close()

    def _joining(self, current: Assembly, probed: list) -> list[str]:
        arrived = [e for e in probed if e.health == "serving"]
        if not arrived:
            return []
        s = self.settings
        members = [e for e in current.entries if e.health == "serving"] + arrived
        local = None
        if self.local is not None:
            # The coordinator's memory as if it held nothing, like an unfixed worker's room.
            local = LocalMember(self.local.available_bytes(), self.local.fixed)
        try:
            plan = plan_stages(members, self.config, s.kv_reserve_tokens, local)
        except WedlmError:
            return []
        now = {e.address: e.layers for e in current.entries if e.layers is not None}
        if current.local is not None:
            now[LOCAL] = current.local
        if plan == now:
            return []
        prefetch(arrived, plan, s.model_source)  # while the current pipeline serves
        return [e.address for e in arrived]

    def waiting_for(self) -> str:
        """Listed workers that are not part of the plan (unreachable or refused)."""
        current = self.assembly
        listed = set(self.settings.static)
        if current is None:
            return ""
        missing = [
            f"{e.address} ({e.health}: {e.detail})" if e.detail else f"{e.address} ({e.health})"
            for e in current.entries
            if e.address in listed and e.health in ("unreachable", "rejected")
        ]
        return ", ".join(missing)
