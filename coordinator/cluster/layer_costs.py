"""Splitting layers of unequal cost between workers in order (layer_plan.py's case of a
heterogeneous model: DeepSeek's dense first layers beside its MoE layers, Gemma 4's
wide global layers beside its local ones).

Each worker takes a contiguous run of layers whose bytes (weights plus KV reserve) fit
its memory. Shares follow memory in bytes, not in layer counts: worker k's run ends at
the layer boundary nearest to where the first k+1 workers' share of the memory would end
it, among the ends that still leave a plan for the workers after it."""

from __future__ import annotations

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
