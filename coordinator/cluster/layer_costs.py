"""How a gap's layers are shared among consecutive workers (layer_plan.py decides which
workers take which gap and says what does not fit).

Layers of one size: counts in proportion to memory, each within the layers a worker has
room for, by largest remainder (`apportion`). Layers of unequal cost (a heterogeneous
model: DeepSeek's dense first layers beside its MoE layers, Gemma 4's wide global layers
beside its local ones): each worker takes a contiguous run whose bytes (weights plus KV
reserve) fit its memory, and worker k's run ends at the layer boundary nearest to where
the first k+1 workers' share of the memory would end it, among the ends that still leave
a plan for the workers after it (`split`)."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from functools import cache
from itertools import accumulate


def fits(costs: list[int], room: list[int]) -> bool:
    """Whether `costs`, in order, split into one nonempty contiguous run per worker of
    `room` (in order), each run within its worker's room."""
    return _coverable(costs, room)[0][0]


def _coverable(costs: list[int], room: list[int]) -> list[list[bool]]:
    """can[k][s]: workers k.. can hold layers s.. (one nonempty run each, in order).
    Backwards over the workers: taking the most that fits first is not always right (the
    next worker may then start at a bigger layer)."""
    n, workers = len(costs), len(room)
    ends = [0, *accumulate(costs)]
    can = [[False] * (n + 1) for _ in range(workers + 1)]
    can[workers][n] = True
    for k in reversed(range(workers)):
        for s in range(n):
            for e in range(s + 1, n + 1):
                if ends[e] - ends[s] > room[k]:
                    break  # costs are positive: longer runs only cost more
                if can[k + 1][e]:
                    can[k][s] = True
                    break
    return can


def split(costs: list[int], room: list[int], memory: list[int]) -> list[int]:
    """Layers per worker (in order) of a split that `fits`, shares by memory in bytes.
    Needs fits(costs, room)."""
    ends = [0, *accumulate(costs)]
    can = _coverable(costs, room)
    total, weight = ends[-1], sum(memory)
    shares, first, before = [], 0, 0
    for k in range(len(room) - 1):
        before += memory[k]
        target = total * before / weight
        candidates = [
            end
            for end in range(first + 1, len(costs) + 1)
            if ends[end] - ends[first] <= room[k] and can[k + 1][end]
        ]
        end = min(candidates, key=lambda e: (abs(ends[e] - target), e))
        shares.append(end - first)
        first = end
    shares.append(len(costs) - first)
    return shares


def group(
    lengths: tuple[int, ...],
    loads: tuple[int, ...],
    memory: tuple[int, ...],
    fits: Callable[[int, int, int], bool],
):
    """Sizes of consecutive worker groups, one per gap (of `lengths` layers), minimising
    the largest load (layers or bytes) per byte of any group's memory; None when no
    grouping fits. fits(gap, first, end): workers first..end-1 can hold that gap."""

    @cache
    def best(gap: int, first: int) -> tuple[Fraction, tuple[int, ...]] | None:
        if gap == len(lengths):
            return (Fraction(0), ()) if first == len(memory) else None
        found = None
        last = len(memory) - (len(lengths) - gap - 1)  # leave a worker for each later gap
        for end in range(first + 1, min(last, first + lengths[gap]) + 1):
            if not fits(gap, first, end) or (rest := best(gap + 1, end)) is None:
                continue
            load = max(Fraction(loads[gap], sum(memory[first:end])), rest[0])
            if found is None or load < found[0]:
                found = (load, (end - first, *rest[1]))
        return found

    result = best(0, 0)
    return None if result is None else list(result[1])


def apportion(total: int, weights: list[int], caps: list[int]) -> list[int]:
    """Split `total` in proportion to `weights`, each share between 1 and its cap, by
    largest remainder (ties to the earlier worker). Needs len <= total <= sum(caps)."""
    quotas = _quotas(total, weights, caps)
    shares = [q.numerator // q.denominator for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (shares[i] - quotas[i], i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1  # a fractional quota is below its integer cap, so this stays in bounds
    return shares


def _quotas(total: int, weights: list[int], caps: list[int]) -> list[Fraction]:
    """Exact quotas clip(lam * weight, 1, cap) summing to `total`: the sum is piecewise linear
    and nondecreasing in lam, so find the piece that holds `total` and solve on it."""
    pairs = list(zip(weights, caps, strict=True))

    def at(lam: Fraction) -> list[Fraction]:
        return [min(max(lam * w, Fraction(1)), Fraction(c)) for w, c in pairs]

    bends = sorted({Fraction(1, w) for w, _ in pairs} | {Fraction(c, w) for w, c in pairs})
    lo = Fraction(0)
    hi = bends[-1]
    for bend in bends:
        if sum(at(bend)) >= total:
            hi = bend
            break
        lo = bend
    f_lo, f_hi = sum(at(lo)), sum(at(hi))
    lam = lo if f_hi == f_lo else lo + (hi - lo) * (total - f_lo) / (f_hi - f_lo)
    return at(lam)
