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
    `room` (in order), each run within its worker's room. Taking as many layers as fit,
    leaving one for each later worker, is optimal: a shorter rest never fits worse."""
    first = 0
    for k, available in enumerate(room):
        last = len(costs) - (len(room) - k - 1)  # leave one layer per later worker
        end, used = first, 0
        while end < last and used + costs[end] <= available:
            used += costs[end]
            end += 1
        if end == first:
            return False
        first = end
    return first == len(costs)


def split(costs: list[int], room: list[int], memory: list[int]) -> list[int]:
    """Layers per worker (in order) of a split that `fits`, shares by memory in bytes.
    Needs fits(costs, room)."""
    ends = [0, *accumulate(costs)]
    total, weight = ends[-1], sum(memory)
    shares, first, before = [], 0, 0
    for k in range(len(room) - 1):
        before += memory[k]
        target = total * before / weight
        last = len(costs) - (len(room) - k - 1)
        candidates = [
            end
            for end in range(first + 1, last + 1)
            if ends[end] - ends[first] <= room[k] and fits(costs[end:], room[k + 1 :])
        ]
        end = min(candidates, key=lambda e: (abs(ends[e] - target), e))
        shares.append(end - first)
        first = end
    shares.append(len(costs) - first)
    return shares
