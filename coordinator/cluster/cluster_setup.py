"""From candidate workers to a pipeline: verify each candidate (an advertisement is
spoofable, so identity is checked on connect), plan layer ranges over the coordinator and
the workers, assign the ranges of workers that have none, order the links by layer and
tell each stage its successor (Route)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from common.errors import WedlmError
from common.kv_format import FULL, KVFormat
from common.layer_range import LayerRange
from common.layer_sizes import layer_weight_bytes
from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.tensor_group.spec import GroupSpec
from common.tls import TlsConfig
from coordinator.cluster.discovery import DiscoveredWorker
from coordinator.cluster.layer_plan import PlanError, WorkerCapacity, plan_layers
from coordinator.cluster.link_survey import LinkSurvey
from coordinator.cluster.tensor_groups import Group, form_groups
from coordinator.cluster.tp_auto import AUTO, AutoChoice, choose
from coordinator.cluster.tp_choice import Shape
from coordinator.cluster.worker_link import WorkerCallError, WorkerLink

log = logging.getLogger(__name__)


@dataclass
class WorkerEntry:
    address: str
    source: str
    health: str  # "serving", "unreachable", "rejected", "spare"
    detail: str = ""
    info: pb.WorkerInfo | None = None
    link: WorkerLink | None = None
    layers: LayerRange | None = None
    group: Group | None = None  # the tensor group it is a member of (None: alone)

    @property
    def follower(self) -> bool:
        """A group member other than its leader: it holds layers but takes no forwards."""
        return self.group is not None and self.group.leader is not self

    @property
    def stage(self) -> bool:
        """A stage of the pipeline: serving, with layers, and not a group's follower."""
        return self.health == "serving" and self.layers is not None and not self.follower


def kv_bytes_per_layer(
    config: ModelConfig, reserve_tokens: int, kv: KVFormat = FULL
) -> tuple[int, ...]:
    """Per layer, the KV reserve of `reserve_tokens` tokens as that layer stores them
    (MLA's latent, a layer with no KV of its own: common/layer_kv.py)."""
    dtype = mx.bfloat16 if _dtype_bytes(config) == 2 else mx.float32
    return tuple(b * reserve_tokens for b in kv.layer_bytes_per_token(config, dtype))


def probe(
    cand: DiscoveredWorker,
    config: ModelConfig,
    secret: str | None,
    cluster: str,
    timeout_s: float = 5.0,
    tls: TlsConfig | None = None,
):
    link = WorkerLink(cand.address, secret, config.identity, tls=tls)
    entry = WorkerEntry(cand.address, cand.source, "rejected", link=link)
    try:
        info = link.info(timeout=timeout_s)
    except WorkerCallError as e:
        entry.health = (
            "unreachable" if e.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "rejected"
        )
        entry.detail = str(e)
        return entry
    entry.info = info
    if info.cluster != cluster:
        entry.detail = f"belongs to cluster {info.cluster!r}, not {cluster!r}"
    elif info.fetches_layers:  # it takes this model, fetching what it lacks
        entry.health = "serving"
        if info.fixed_range:
            entry.layers = LayerRange(info.layer_start, info.layer_end)
    elif info.model_identity != config.identity:
        entry.detail = f"serves model {info.model_identity}, not {config.identity}"
    elif info.num_layers != config.num_layers:
        entry.detail = f"its model has {info.num_layers} layers, not {config.num_layers}"
    else:
        entry.health = "serving"
        if info.fixed_range:
            entry.layers = LayerRange(info.layer_start, info.layer_end)
    return entry


LOCAL = "coordinator"  # the coordinator's own key in a plan


@dataclass(frozen=True)
class LocalMember:
    """The coordinator as a pipeline stage: it can only hold the first layers (next to the
    embedding), so a plan that would give it a later range leaves it without layers."""

    available_bytes: int  # what it could give to layers and KV (its held layers included)
    fixed: LayerRange | None = None  # --layers
    group_port: int = 0  # where its group process would listen (0: it joins no group)
    group_backends: tuple[str, ...] = ()
    rdma_ports: tuple = ()  # RdmaPort: its Thunderbolt cables (jaccl)


def local_entry(local: LocalMember) -> WorkerEntry:
    """The coordinator as a candidate member of the first tensor group (never a link)."""
    info = pb.WorkerInfo(
        memory_available=local.available_bytes,
        fixed_range=local.fixed is not None,
        group_port=local.group_port,
        group_backends=local.group_backends,
        rdma_ports=[pb.RdmaPort(**asdict(p)) for p in local.rdma_ports],
    )
    return WorkerEntry(LOCAL, "local", "serving", info=info)


@dataclass
class Assembly:
    entries: list[WorkerEntry]  # every candidate; the serving ones with layers, in order
    local: LayerRange | None  # the coordinator's own range
    epoch: int = 0
    groups: list[Group] = field(default_factory=list)  # the tensor groups that formed
    note: str = ""  # why the plan has these stages (--tp)
    local_member: object = None  # the coordinator's group process (rank 0), if grouped
    auto: AutoChoice | None = None  # what --tp auto measured and chose

    @property
    def links(self) -> list[WorkerLink]:
        return pipeline_links(self.entries)

    def layout(self) -> str:
        stages = []
        if self.local:
            lead = next((g for g in self.groups if g.leader.address == LOCAL), None)
            stages.append(f"{lead.describe() if lead else 'coordinator'} [{self.local}]")
        for e in self.entries:
            if e.stage:
                who = e.group.describe() if e.group is not None else e.address
                stages.append(f"{who} [{e.layers}]")
        return ", ".join(stages)


def probe_all(
    candidates: list[DiscoveredWorker],
    config: ModelConfig,
    secret: str | None,
    cluster: str,
    timeout_s: float = 5.0,
    tls: TlsConfig | None = None,
) -> list[WorkerEntry]:
    if not candidates:
        return []
    with ThreadPoolExecutor(min(len(candidates), 16)) as pool:
        return list(
            pool.map(lambda c: probe(c, config, secret, cluster, timeout_s, tls), candidates)
        )


def plan_stages(
    entries: list[WorkerEntry],
    config: ModelConfig,
    kv_reserve_tokens: int,
    local: LocalMember | None,
    grouped_local: WorkerEntry | None = None,
    kv_format: KVFormat = FULL,
) -> dict[str, LayerRange]:
    """Layer ranges of the coordinator (key LOCAL) and the serving workers; raises
    PlanError when no valid plan exists. `grouped_local`: the coordinator's entry when
    it leads a tensor group (its room is then the group's)."""
    usable = [e for e in entries if e.health == "serving" and not e.follower]
    if not usable and local is None:
        details = "; ".join(f"{e.address}: {e.detail}" for e in entries) or "none found"
        raise PlanError(f"no usable worker ({details})")
    per_layer = layer_weight_bytes(config)  # each layer's own bytes, as stored
    workers = [WorkerCapacity(e.address, _group_room(e, per_layer), _fixed(e)) for e in usable]
    kv = kv_bytes_per_layer(config, kv_reserve_tokens, kv_format)
    if local is not None:
        local_room = local.available_bytes
        if grouped_local is not None and grouped_local.group is not None:
            local_room = _group_room(grouped_local, per_layer)
        try:
            plan = plan_layers(
                config.num_layers,
                [WorkerCapacity(LOCAL, local_room, local.fixed), *workers],
                per_layer,
                kv,
            )
        except PlanError:
            if local.fixed is not None or not workers:
                raise
            plan = None
        if plan is not None and (LOCAL not in plan or plan[LOCAL].start == 0):
            return plan
        if not workers:
            raise PlanError("the coordinator can only hold the first layers")
    return plan_layers(config.num_layers, workers, per_layer, kv)


def _dtype_bytes(config: ModelConfig) -> int:
    return 2 if str(config.raw.get("torch_dtype", "")).endswith("16") else 4


def model_shape(config: ModelConfig) -> Shape:
    """What `--tp auto` weighs: the layers' weight bytes and a token's hidden state."""
    hidden = config.hidden_size * _dtype_bytes(config)
    per_layer = layer_weight_bytes(config)
    return Shape(config.num_layers, sum(per_layer) // len(per_layer), hidden)


def assemble(
    candidates: list[DiscoveredWorker],
    config: ModelConfig,
    secret: str | None,
    cluster: str,
    kv_reserve_tokens: int,
    probe_timeout_s: float = 5.0,
    tls: TlsConfig | None = None,
    local: LocalMember | None = None,
    epoch: int = 0,
    model_source: str = "",
    kv: KVFormat = FULL,
    tp: int | str = 1,
    start_local: Callable[[LayerRange, GroupSpec], object] | None = None,
    survey: LinkSurvey | None = None,
) -> Assembly:
    """Probe, plan, assign and route. Every candidate gets an entry; the serving ones with
    layers, in layer order, form the chain behind the coordinator's own range (a tensor
    group counts as one stage, its leader in the chain). A group that does not form is
    planned again as single stages. `tp` "auto": the group size is chosen from `survey`'s
    measurements (tp_auto.py). Raises PlanError when no valid plan exists,
    WorkerCallError when a worker fails on the way."""
    entries = probe_all(candidates, config, secret, cluster, probe_timeout_s, tls)
    me = local_entry(local) if local is not None and start_local is not None else None
    auto = None
    if tp == AUTO:
        auto = choose(entries, config, model_shape(config), me, (survey or LinkSurvey()).measure)
        tp = auto.size
    groups, note = form_groups(entries, config, tp, me)
    if auto is not None:
        note = f"{auto.note}; {note}" if note else auto.note
    while True:
        for g in groups:
            for m in g.members:
                m.group = g
        plan = plan_stages(entries, config, kv_reserve_tokens, local, me, kv)
        started: list = []
        failed = _load(entries, plan, config, model_source, kv, epoch, me, start_local, started)
        if not failed:
            break
        for member in started:  # the coordinator's part of a group that did not form
            member.stop()
        for g in failed:  # its members are planned alone, and the note says why
            for m in g.members:
                m.group = None
            note = f"{note}; {g.describe()} did not form: {g.failed}" if note else g.failed
            log.warning("tensor group %s did not form: %s", g.describe(), g.failed)
        groups = [g for g in groups if not g.failed]
    entries.sort(key=lambda e: (e.layers.start if e.layers else 1 << 30, e.address))
    _route(entries, epoch)
    started_member = started[0] if started else None
    return Assembly(entries, plan.get(LOCAL), epoch, groups, note, started_member, auto)


def _load(
    entries: list[WorkerEntry],
    plan: dict[str, LayerRange],
    config: ModelConfig,
    model_source: str,
    kv: KVFormat,
    epoch: int,
    me: WorkerEntry | None = None,
    start_local: Callable[[LayerRange, GroupSpec], object] | None = None,
    started: list | None = None,
) -> list[Group]:
    """Assign the plan's ranges (every member of a group the range of its leader), and
    start the coordinator's group process when it leads one, all at once (a group forms
    only when every member joins). The groups that failed to form (`failed` says why);
    the coordinator's started group process is appended to `started`."""
    todo = []
    for e in entries:
        if e.health != "serving":
            continue
        key = e.group.leader.address if e.group is not None else e.address
        if key not in plan:
            e.health, e.layers = "spare", None
            continue
        e.layers = plan[key]
        current = LayerRange(e.info.layer_start, e.info.layer_end) if e.info.has_layers else None
        stored = KVFormat(e.info.kv_bits or None, e.info.kv_group_size or kv.group_size)
        alone = e.group is None and e.info.group_size == 0
        if (
            current != e.layers
            or e.info.model_identity != config.identity
            or stored != kv
            or not alone
        ):
            todo.append(e)
    failed: dict[int, Group] = {}
    lead = me if me is not None and me.group is not None and LOCAL in plan else None
    if todo or lead:  # workers load (and fetch) their ranges at the same time
        with ThreadPoolExecutor(len(todo) + 1) as pool:
            mine = (
                pool.submit(start_local, plan[LOCAL], lead.group.spec(0, epoch)) if lead else None
            )
            assigned = pool.map(lambda e: _assign_member(e, model_source, kv, epoch), todo)
            if mine is not None:
                try:
                    started.append(mine.result())
                except WedlmError as error:
                    lead.group.failed = f"the coordinator: {error}"
                    failed[id(lead.group)] = lead.group
            for e, (info, error) in zip(todo, assigned, strict=True):
                if error is None:
                    e.info = info
                elif e.group is not None:
                    e.info.has_layers = False  # it left what it held to join the group
                    e.group.failed = e.group.failed or f"{e.address}: {error.message}"
                    failed[id(e.group)] = e.group
                else:
                    raise error
    return list(failed.values())


def _assign_member(
    entry: WorkerEntry, model_source: str, kv: KVFormat, epoch: int
) -> tuple[pb.WorkerInfo | None, WorkerCallError | None]:
    try:
        return _assign(entry, model_source, kv, epoch), None
    except WorkerCallError as e:
        return None, e


def _route(entries: list[WorkerEntry], epoch: int) -> None:
    """Tell every stage its successor, the last first: a stage only relays to a successor
    that already follows the same plan."""
    stages = [e for e in entries if e.stage]
    for i in reversed(range(len(stages))):
        nxt = stages[i + 1].address if i + 1 < len(stages) else ""
        prev = stages[i - 1].address if i > 0 else ""
        stages[i].info = stages[i].link.route(epoch, nxt, prev)


def _fixed(entry: WorkerEntry) -> LayerRange | None:
    info = entry.info
    return LayerRange(info.layer_start, info.layer_end) if info.fixed_range else None


def _assign(entry: WorkerEntry, model_source: str, kv: KVFormat, epoch: int) -> pb.WorkerInfo:
    g = entry.group
    spec = g.spec(g.members.index(entry), epoch) if g is not None else None
    log.info(
        "assigning layers %s to %s%s",
        entry.layers,
        entry.address,
        f" (rank {spec.rank} of tensor group {g.describe()})" if spec else "",
    )
    r = entry.layers
    return entry.link.assign(r.start, r.end, model_source, kv=kv, group=spec)


def prefetch(arrived: list[WorkerEntry], plan: dict[str, LayerRange], model_source: str) -> None:
    """Have joining workers that fetch their layers do it now, while the current pipeline
    keeps serving, so that the re-plan that takes them in finds the layers on their disks.
    A failure is only logged: the re-plan's own Assign tries again and reports it."""
    fetching = [e for e in arrived if e.info.fetches_layers and e.address in plan]
    for e in fetching:
        r = plan[e.address]
        log.info("%s fetches layers %s before the re-plan", e.address, r)
        try:
            e.link.assign(r.start, r.end, model_source, fetch_only=True)
        except WorkerCallError as err:
            log.warning("prefetch on %s failed: %s", e.address, err)


def _room(entry: WorkerEntry, per_layer: tuple[int, ...]) -> int:
    """Memory a worker could give: what is free plus what its current layers occupy (an
    unfixed worker drops them when it is assigned a new range)."""
    info = entry.info
    held = 0
    if info.has_layers and not info.fixed_range:
        held = sum(per_layer[info.layer_start : info.layer_end + 1])
    return int(info.memory_available) + held


def _group_room(entry: WorkerEntry, per_layer: tuple[int, ...]) -> int:
    """A stage's room: a group holds 1/N of each layer and of its KV on every member, so
    N members with the least room among them hold N times what that member would."""
    if entry.group is None:
        return _room(entry, per_layer)
    members = entry.group.members
    return len(members) * min(_room(m, per_layer) for m in members)


def pipeline_links(entries: list[WorkerEntry]) -> list[WorkerLink]:
    return [e.link for e in entries if e.stage]
