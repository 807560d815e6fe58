"""Which workers form tensor-parallel groups (`--tp N`): a group is one pipeline stage whose
N members each hold 1/N of every layer of its range, joined by an mlx.distributed backend
they all have. Its leader (rank 0) is the stage the pipeline sends to; the others take
their work from it inside the group. What cannot be grouped is planned as a pipeline, and
the plan's note says why."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

from common.model_config import ModelConfig
from common.tensor_group.spec import GroupSpec, shard_problem
from coordinator.cluster.rdma_mesh import device_matrix

log = logging.getLogger(__name__)
# The backends a group is formed over, in order of preference: jaccl (RDMA over
# Thunderbolt 5) when every pair of members is cabled, then nccl (CUDA), then ring (TCP).
GROUP_BACKENDS = ("jaccl", "nccl", "ring")


@dataclass
class Group:
    members: list  # WorkerEntry, rank order
    backend: str
    failed: str = ""  # why it did not form (then its members are planned alone)
    hosts: list[str] = field(default_factory=list)
    rdma: list[list[str]] = field(default_factory=list)  # jaccl: the device matrix

    @property
    def leader(self):
        return self.members[0]

    @property
    def addresses(self) -> list[str]:
        return [m.address for m in self.members]

    def spec(self, rank: int, epoch: int) -> GroupSpec:
        return GroupSpec(rank, len(self.members), self.hosts, self.backend, epoch, self.rdma)

    def describe(self) -> str:
        return f"{' + '.join(self.addresses)} (tp={len(self.members)}, {self.backend})"


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def _ip_toward(address: str) -> str:
    """This machine's address on the route to `address` (the coordinator's own host in a
    group's hostfile, as its members reach it); no packet is sent."""
    host, port = address.rsplit(":", 1)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), int(port)))
        return s.getsockname()[0]


def _hosts(members: list) -> list[str]:
    workers = [m.address for m in members if m.source != "local"]
    out = []
    for m in members:
        host = _ip_toward(workers[0]) if m.source == "local" else _host(m.address)
        out.append(f"{host}:{m.info.group_port}")
    return out


def _backend(members: list) -> tuple[str | None, list[list[str]]]:
    """The first backend every member has, and for jaccl its device matrix (jaccl is
    passed over when some pair of members is not cabled)."""
    for backend in GROUP_BACKENDS:
        if not all(backend in m.info.group_backends for m in members):
            continue
        if backend != "jaccl":
            return backend, []
        matrix = device_matrix([list(m.info.rdma_ports) for m in members])
        if matrix is not None:
            return backend, matrix
        log.info("jaccl passed over: not every pair of %s is cabled", [m.address for m in members])
    return None, []


def form_groups(entries: list, config: ModelConfig, tp: int, local=None) -> tuple[list[Group], str]:
    """Groups of `tp` serving workers (in the candidates' order) and the plan's note;
    `local`, the coordinator's entry, leads the first group when it can (it holds the
    first layers). A member started with --layers, one without a group port, and the
    remainder past the last full group stay pipeline stages."""
    groups, note = group_members(entries, config, tp, local)
    if note.startswith("--tp"):
        log.warning("%s", note)
    elif note:
        log.info("--tp %d: %s", tp, note)
    return groups, note


def groupable(entries: list, local=None) -> list:
    """The candidates that can join a group: serving, not started with --layers, and
    with a port for a group process."""
    return [
        e
        for e in ([local] if local is not None else []) + entries
        if e.health == "serving" and not e.info.fixed_range and e.info.group_port > 0
    ]


def group_members(entries: list, config: ModelConfig, tp: int, local=None):
    """form_groups without its log line (`--tp auto` weighs every size)."""
    if tp <= 1:
        return [], ""
    problem = shard_problem(config, tp)
    if problem is not None:
        return [], f"--tp {tp}: a pipeline, because {problem}"
    free = groupable(entries, local)
    groups: list[Group] = []
    alone: list[str] = []
    while len(free) >= tp:
        members, free = free[:tp], free[tp:]
        backend, rdma = _backend(members)
        if backend is None:
            alone += [m.address for m in members]
            continue
        groups.append(Group(members, backend, hosts=_hosts(members), rdma=rdma))
    alone += [e.address for e in free]
    notes = [f"tensor group {g.describe()}" for g in groups]
    if alone:
        notes.append(f"alone (no group of {tp} with a shared backend): {', '.join(alone)}")
    return groups, "; ".join(notes)
