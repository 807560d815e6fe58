"""Which worker holds which layers.

Workers started with `--layers` keep their ranges. The layers they leave free (the gaps) go to
the workers without a range, in proportion to memory. With no fixed worker the whole model is
one gap.

The rule for mixing fixed and free workers:
- fixed ranges must lie inside the model and must not overlap;
- with no free worker, every gap is an error; with free workers but no gap, that is an error too
  (a worker nobody needs is probably a mistake in the layer flags);
- the free workers, in the order given, are cut into consecutive groups, one group per gap in
  layer order, and each group splits its gap. Every free worker gets at least one layer and
  holds one contiguous range, so there must be at least one free worker per gap and at most one
  per free layer. Of the groupings that fit in memory the planner takes the one whose most
  loaded group (layers per byte of memory) is least loaded, the earliest on ties.

Memory: a layer costs `layer_bytes` of weights plus `kv_bytes_per_layer` of KV reserve, so a
worker has room for `available_bytes // (layer_bytes + kv_bytes_per_layer)` layers. Within that
limit, shares follow available memory, which is the same as following usable memory after the
per-layer KV reserve: every worker is left the same room for KV per layer it holds. Fixed
workers are not checked against memory: they loaded their layers already.

Both sizes may also be given per layer (a heterogeneous model: dense and MoE layers, layers
whose KV differs). Layers of unequal cost are split by bytes (layer_costs.py): each worker's
run fits its memory and shares follow memory in bytes.

Deterministic: the given order of the free workers is the pipeline order of their ranges, so the
caller decides it (a static list first, then the discovered workers sorted by address, say).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import WedlmError
from common.layer_range import LayerRange
from coordinator.cluster import layer_costs


@dataclass(frozen=True)
class WorkerCapacity:
    key: str  # address or node id: names the worker in the plan and in messages
    available_bytes: int  # memory it can give to weights and KV (not counting fixed layers)
    fixed: LayerRange | None = None  # the range it was started with (`--layers`)


class PlanError(WedlmError):
    """No plan exists for these workers; the message names the workers and layers at fault.
    `final`: no worker that joins later can fix it (overlapping or impossible --layers)."""

    def __init__(self, message: str, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


def plan_layers(
    num_layers: int,
    workers: list[WorkerCapacity],
    layer_bytes: int | Sequence[int],
    kv_bytes_per_layer: int | Sequence[int],
) -> dict[str, LayerRange]:
    """Map each worker's key to its range; the ranges tile 0..num_layers-1 exactly and the
    dict is ordered by layer (pipeline order). Sizes are one for every layer, or one per
    layer."""
    weights = _per_layer(layer_bytes, num_layers)
    kv = _per_layer(kv_bytes_per_layer, num_layers)
    if num_layers < 1 or min(weights) < 1 or min(kv) < 0:
        raise ValueError(f"bad model sizes: {num_layers} layers of {layer_bytes} bytes")
    if not workers:
        raise PlanError(f"no worker to hold the model's {num_layers} layers")
    keys = [w.key for w in workers]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise PlanError(f"worker {', '.join(twice)} is listed twice", final=True)

    fixed = [w for w in workers if w.fixed is not None]
    free = [w for w in workers if w.fixed is None]
    problems = _fixed_problems(num_layers, fixed)
    final = bool(problems)  # overlaps and ranges past the model: no newcomer fixes them
    gaps = _gaps(num_layers, fixed)
    if not free:
        problems += [f"{_span(g.start, g.end)} held by no worker" for g in gaps]
    if problems:
        raise PlanError("; ".join(problems), final=final)

    plan = {w.key: w.fixed for w in fixed if w.fixed is not None}
    if free:
        plan.update(_fill(num_layers, gaps, free, weights, kv, bool(fixed)))
    return dict(sorted(plan.items(), key=lambda item: item[1].start))


def _per_layer(size: int | Sequence[int], num_layers: int) -> tuple[int, ...]:
    if isinstance(size, int):
        return (size,) * max(num_layers, 1)
    if len(size) != num_layers:
        raise ValueError(f"{len(size)} layer sizes for a model of {num_layers} layers")
    return tuple(int(s) for s in size)


def _fixed_problems(num_layers: int, fixed: list[WorkerCapacity]) -> list[str]:
    problems = []
    ranged = sorted((w.fixed, w.key) for w in fixed if w.fixed is not None)
    for rng, key in ranged:
        if rng.end >= num_layers:
            problems.append(
                f"worker {key} holds {rng} but the model has {num_layers} layers "
                f"(0-{num_layers - 1})"
            )
    for i, (a, key_a) in enumerate(ranged):
        for b, key_b in ranged[i + 1 :]:
            lo, hi = max(a.start, b.start), min(a.end, b.end, num_layers - 1)
            if lo <= hi:
                problems.append(f"{_span(lo, hi)} held by both {key_a} and {key_b}")
    return problems


def _gaps(num_layers: int, fixed: list[WorkerCapacity]) -> list[LayerRange]:
    held = [False] * num_layers
    for w in fixed:
        if w.fixed is not None:
            for layer in range(w.fixed.start, min(w.fixed.end, num_layers - 1) + 1):
                held[layer] = True
    gaps, start = [], None
    for layer, is_held in enumerate([*held, True]):
        if not is_held and start is None:
            start = layer
        elif is_held and start is not None:
            gaps.append(LayerRange(start, layer - 1))
            start = None
    return gaps


def _fill(
    num_layers: int,
    gaps: list[LayerRange],
    free: list[WorkerCapacity],
    weights: tuple[int, ...],
    kv: tuple[int, ...],
    mixed: bool,
) -> dict[str, LayerRange]:
    names = ", ".join(w.key for w in free)
    plural = "s" if len(free) > 1 else ""
    who = f"{len(free)} worker{plural}" + (f" without --layers ({names})" if mixed else "")
    if not gaps:
        raise PlanError(
            f"{who} got no layer: the workers started with --layers already hold "
            f"all {num_layers} layers (0-{num_layers - 1})"
        )
    free_layers = sum(len(g) for g in gaps)
    where = ", ".join(str(g) for g in gaps)
    what = (
        f"the {free_layers} layers left free ({where})"
        if mixed
        else f"the model's {num_layers} layers"
    )
    if len(free) > free_layers:
        pool = f"only {free_layers} free layers ({where})" if mixed else f"{num_layers} layers"
        raise PlanError(f"{who} but the model has {pool}: each worker needs at least one layer")
    if len(free) < len(gaps):
        raise PlanError(
            f"{_span_list(gaps)} held by no worker, and {who} cannot cover {len(gaps)} separate "
            "gaps: each takes one contiguous range"
        )
    memory = [w.available_bytes for w in free]
    if len(set(zip(weights, kv, strict=True))) > 1:
        return _fill_bytes(gaps, free, weights, kv, who, what, where)
    layer_bytes, kv_bytes_per_layer = weights[0], kv[0]
    per_layer = layer_bytes + kv_bytes_per_layer
    room = [w.available_bytes // per_layer for w in free]
    for w, fits in zip(free, room, strict=True):
        if fits < 1:
            raise PlanError(
                f"worker {w.key} has room for no layer: {_size(w.available_bytes)} available, "
                f"one layer needs {_size(layer_bytes)} plus {_size(kv_bytes_per_layer)} of KV "
                "reserve"
            )
    if sum(room) < free_layers:
        missing = free_layers - sum(room)
        raise PlanError(
            f"{what} do not fit: they need {_size(free_layers * per_layer)} "
            f"({_size(layer_bytes)} of weights and {_size(kv_bytes_per_layer)} of KV reserve "
            f"each) but {who} can hold only {sum(room)}; about {_size(missing * per_layer)} "
            f"more memory ({missing} layers' worth) is missing"
        )
    lengths = tuple(len(g) for g in gaps)
    sizes = layer_costs.group(
        lengths, lengths, tuple(memory), lambda g, a, b: sum(room[a:b]) >= lengths[g]
    )
    if sizes is None:
        raise PlanError(_no_grouping(who, where))
    shares: list[int] = []
    first = 0
    for gap, size in zip(gaps, sizes, strict=True):
        workers = range(first, first + size)
        shares += layer_costs.apportion(
            len(gap), [memory[i] for i in workers], [room[i] for i in workers]
        )
        first += size
    return _ranges(gaps, sizes, shares, free)


def _fill_bytes(
    gaps: list[LayerRange],
    free: list[WorkerCapacity],
    weights: tuple[int, ...],
    kv: tuple[int, ...],
    who: str,
    what: str,
    where: str,
) -> dict[str, LayerRange]:
    """`_fill` for layers of unequal cost: the same checks and grouping, in bytes."""
    cost = [w + k for w, k in zip(weights, kv, strict=True)]
    free_set = [i for g in gaps for i in g]
    cheapest = min(free_set, key=lambda i: cost[i])
    for w in free:
        if w.available_bytes < cost[cheapest]:
            raise PlanError(
                f"worker {w.key} has room for no layer: {_size(w.available_bytes)} available, "
                f"the smallest layer ({cheapest}) needs {_size(weights[cheapest])} plus "
                f"{_size(kv[cheapest])} of KV reserve"
            )
    need = sum(cost[i] for i in free_set)
    have = sum(w.available_bytes for w in free)
    memory = [w.available_bytes for w in free]
    if need > have:
        raise PlanError(
            f"{what} do not fit: they need {_size(need)} "
            f"({_size(sum(weights[i] for i in free_set))} of weights and "
            f"{_size(sum(kv[i] for i in free_set))} of KV reserve; the layers differ in size) "
            f"but {who} have {_size(have)}; about {_size(need - have)} more memory is missing"
        )
    runs = [[cost[i] for i in g] for g in gaps]
    sizes = layer_costs.group(
        tuple(len(g) for g in gaps),
        tuple(sum(r) for r in runs),
        tuple(memory),
        lambda g, a, b: layer_costs.fits(runs[g], memory[a:b]),
    )
    if sizes is None and len(gaps) == 1:
        raise PlanError(
            f"{what} fit {who} in total but not in order: no contiguous split gives each "
            "worker a range that fits its memory (the layers differ in size); more memory "
            "or another order of the workers is needed"
        )
    if sizes is None:
        raise PlanError(_no_grouping(who, where))
    shares: list[int] = []
    first = 0
    for run, size in zip(runs, sizes, strict=True):
        group = memory[first : first + size]
        shares += layer_costs.split(run, group, group)
        first += size
    return _ranges(gaps, sizes, shares, free)


def _no_grouping(who: str, where: str) -> str:
    return (
        f"no way to split {who} into consecutive groups, one per gap ({where}), that fits "
        "each gap in its group's memory; reorder the workers or change their --layers"
    )


def _ranges(
    gaps: list[LayerRange], sizes: list[int], shares: list[int], free: list[WorkerCapacity]
) -> dict[str, LayerRange]:
    """Each gap's consecutive workers' shares as ranges, in order."""
    plan, worker = {}, 0
    for gap, size in zip(gaps, sizes, strict=True):
        start = gap.start
        for _ in range(size):
            plan[free[worker].key] = LayerRange(start, start + shares[worker] - 1)
            start += shares[worker]
            worker += 1
    return plan


def _span(lo: int, hi: int) -> str:
    return f"layer {lo} is" if lo == hi else f"layers {lo}-{hi} are"


def _span_list(gaps: list[LayerRange]) -> str:
    if len(gaps) == 1:
        return _span(gaps[0].start, gaps[0].end)
    return "layers " + ", ".join(str(g) for g in gaps) + " are"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
