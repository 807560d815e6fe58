"""`--tp auto` (the default): which group size the plan uses. Every size that the model's
heads, KV heads and MLP divide by and that the candidates allow (members with a group port
and a shared backend, as `--tp N` would group them) is projected from measured figures
(coordinator/cluster/tp_choice.py) against a pipeline; the lowest per-token time wins.
Nothing is measured when there is nothing to choose (one member, no size that divides)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.tensor_group.spec import shard_problem
from coordinator.cluster.tensor_groups import group_members, groupable
from coordinator.cluster.tp_choice import Figures, Projection, Shape, best, project, reason

log = logging.getLogger(__name__)
AUTO = "auto"
Measure = Callable[[list, list], Figures]


@dataclass
class AutoChoice:
    size: int  # the group size chosen (1: a pipeline)
    note: str  # why, for `wedlm status`
    links: list[pb.LinkFigures] = field(default_factory=list)  # what was measured
    reads: dict[str, float] = field(default_factory=dict)  # bytes/s by member


def choose(entries: list, config: ModelConfig, shape: Shape, local, measure: Measure) -> AutoChoice:
    """The group size for this plan over `entries` (probed candidates) and `local` (the
    coordinator's entry, None when it holds no layers); `measure(members, pairs)` gives
    the figures (LinkSurvey.measure)."""
    members = ([local] if local is not None else []) + [e for e in entries if e.health == "serving"]
    if len(members) < 2:
        return AutoChoice(1, "tp auto: pipeline — one member holds every layer")
    options = {}
    for size in range(2, len(members) + 1):
        groups, _ = group_members(entries, config, size, local)
        if groups:
            options[size] = [g.members for g in groups]
    if not options:
        problem = shard_problem(config, 2)
        _, note = group_members(entries, config, 2, local)
        why = problem or note or "no two members can form a group"
        return AutoChoice(1, f"tp auto: pipeline — {why}")
    free = groupable(entries, local)
    pairs = [(a, b) for i, a in enumerate(free) for b in free[i + 1 :]]
    figures = measure(members, pairs)
    names = [m.address for m in members]
    projections = [project(shape, [[n] for n in names], figures, 1)]
    for size, groups in options.items():
        inside = {m.address for g in groups for m in g}
        stages = [[m.address for m in g] for g in groups] + [[n] for n in names if n not in inside]
        projections.append(project(shape, stages, figures, size))
    chosen = _choose(projections)
    note = reason(chosen, projections) if not projections[0].problem else (
        f"tp auto: pipeline — {projections[0].problem}"
    )  # fmt: skip
    log.info("%s", note)
    return AutoChoice(chosen.size, note, list(figures.links.values()), dict(figures.reads))


def _choose(projections: list[Projection]) -> Projection:
    if projections[0].problem:  # nothing is known of the members' reads: no grounds for TP
        return projections[0]
    return best(projections)
