"""Which sequences run in the next micro-batch, and the one place their state changes.

Decode sequences live in P stable groups (one micro-batch each), so the workers' KV batches
keep their membership from tick to tick; a sequence joins the least-loaded group when its
prefill ends. Prefill runs as its own micro-batches, in chunks, taking turns with the
decode groups, so a long new prompt never stalls running streams."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.errors import WedlmError
from coordinator.engine.forward_shapes import padded_width, row_bucket
from coordinator.engine.prefix_cache import PrefixCache
from coordinator.engine.row_plan import RowPlan, apply_result, plan_next
from coordinator.engine.sequence import Phase, Sequence

PREFILL = -1  # the unit key of prefill micro-batches; decode groups are 0..P-1


class QueueFull(WedlmError):
    """The waiting queue is at its limit (requests or prompt tokens)."""


@dataclass
class Limits:
    max_running: int = 16
    max_queued: int = 256
    max_queued_tokens: int = 1 << 20
    prefill_chunk: int = 512  # prompt tokens of one sequence per forward
    prefill_budget: int = 1024  # padded prompt rows per prefill micro-batch
    kv_tokens: int | None = None  # KV tokens the workers' free memory holds (None: unknown)


@dataclass
class Commit:
    seq: Sequence
    tokens: list[int]  # newly committed (may be empty when only finishing)


@dataclass
class Scheduler:
    limits: Limits
    groups_count: int
    mask_token_id: int
    max_positions: int
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    groups: list[list[Sequence]] = field(default_factory=list)
    busy: set[int] = field(default_factory=set)  # unit keys with a micro-batch in flight
    cache: PrefixCache | None = None  # finished sequences' KV rows, reused by new prompts
    _turn: int = 0

    def __post_init__(self) -> None:
        self.groups = [[] for _ in range(self.groups_count)]

    # ---- requests ------------------------------------------------------------------
    @staticmethod
    def kv_need(seq: Sequence) -> int:
        """Worst-case KV rows of a sequence: its prompt, every token it may commit, and the
        rows a forward writes past the committed length."""
        return len(seq.prompt) + seq.params.max_tokens + seq.params.forward_rows

    def kv_in_use(self) -> int:
        return sum(self.kv_need(s) for s in self.running if not s.finished)

    def add(self, seq: Sequence) -> None:
        budget = self.limits.kv_tokens
        if budget is not None and self.kv_need(seq) > budget:
            raise QueueFull(
                f"the request may need {self.kv_need(seq)} KV rows; the workers' free memory "
                f"holds {budget} (lower max_tokens or add workers)"
            )
        queued_tokens = sum(len(s.prompt) for s in self.waiting)
        free = max(self.limits.max_running - len(self.running), 0)  # admitted at the next tick
        if len(self.waiting) >= self.limits.max_queued + free:
            raise QueueFull(f"the queue is full ({self.limits.max_queued} requests waiting)")
        if queued_tokens + len(seq.prompt) > self.limits.max_queued_tokens:
            raise QueueFull(
                f"the queue is full ({queued_tokens} prompt tokens waiting, "
                f"limit {self.limits.max_queued_tokens})"
            )
        self.waiting.append(seq)

    def admit(self) -> None:
        """Start waiting sequences while slots and KV memory allow; the rest keep waiting
        (admission by measured free memory: overload queues instead of crashing). Cached
        KV counts like running KV, and is evicted when a request needs its room."""
        budget = self.limits.kv_tokens
        in_use = self.kv_in_use() if budget is not None else 0
        cache = self.cache
        while self.waiting and len(self.running) < self.limits.max_running:
            seq = self.waiting[0]
            if seq.finished:  # cancelled while queued
                self.waiting.popleft()
                continue
            hit = cache.find(seq.prompt) if cache is not None and not seq.rebuild_to else None
            if budget is not None:
                need = in_use + self.kv_need(seq)
                if cache is not None and need + cache.tokens > budget:
                    spare = hit.source if hit is not None else None  # the room is made around it
                    cache.shrink(max(budget - need, 0), spare=spare)
                cached = cache.tokens if cache is not None else 0
                if need + cached > budget and self.running:
                    return
            self.waiting.popleft()
            in_use += self.kv_need(seq)
            if cache is not None:
                cache.stats.lookups += 1
                if hit is not None:
                    cache.take(hit)
                    seq.start_from(hit)
            seq.phase = Phase.PREFILL
            self.running.append(seq)

    def cancel(self, seq: Sequence) -> None:
        if seq.finished:
            return
        seq.finish_reason = "cancelled"
        seq.phase = Phase.FINISHED
        if seq in self.waiting:
            self.waiting.remove(seq)

    # ---- forming micro-batches -------------------------------------------------------
    def units(self) -> list[int]:
        return [PREFILL, *range(self.groups_count)]

    def next_micro_batch(self, commits: list[Commit]) -> tuple[int, list[RowPlan]] | None:
        """The next unit with work that is not in flight, round robin, and its plans."""
        units = self.units()
        for i in range(len(units)):
            unit = units[(self._turn + i) % len(units)]
            if unit in self.busy:
                continue
            plans = self._plans(unit, commits)
            if plans:
                self._turn = (self._turn + i + 1) % len(units)
                self.busy.add(unit)
                return unit, plans
        return None

    def _plans(self, unit: int, commits: list[Commit]) -> list[RowPlan]:
        if unit == PREFILL:
            return self._prefill_plans()
        plans = []
        for seq in self.groups[unit]:
            if seq.finished:
                continue
            plan = plan_next(seq, self.mask_token_id, self.limits.prefill_chunk, self.max_positions)
            if plan.commits and seq.would_finish(plan.commits):
                # The tokens that end the sequence are known: no forward is needed.
                before = len(seq.output)
                seq.commit(plan.commits)
                seq.phase = Phase.FINISHED
                commits.append(Commit(seq, seq.output[before:]))
            elif seq.kv_length + plan.width > self.max_positions:
                seq.finish_reason = "length"
                seq.phase = Phase.FINISHED
                commits.append(Commit(seq, []))
            else:
                plans.append(plan)
        return plans

    def _prefill_plans(self) -> list[RowPlan]:
        plans: list[RowPlan] = []
        width = 0
        for seq in self.running:
            if seq.phase is not Phase.PREFILL or seq.finished:
                continue
            plan = plan_next(seq, self.mask_token_id, self.limits.prefill_chunk, self.max_positions)
            # the forward's size once padded (forward_shapes): it stays within the budget
            padded = padded_width(max(width, plan.width)) * row_bucket(len(plans) + 1)
            if plans and padded > self.limits.prefill_budget:
                break
            plans.append(plan)
            width = max(width, plan.width)
        return plans

    # ---- the only place sequences change state ---------------------------------------
    def postprocess(
        self, unit: int, plans: list[RowPlan], fills, tokens, started: float
    ) -> list[Commit]:
        """`started`: when this forward's launch began (wall times are spans from the
        first launch, so overlapping forwards are not counted twice)."""
        self.busy.discard(unit)
        commits = []
        done_at = time.perf_counter()
        for i, plan in enumerate(plans):
            seq = plan.seq
            if seq.finished:  # cancelled while its forward was in flight
                continue
            k = plan.head_slots.size
            was_prefill = seq.phase is Phase.PREFILL
            new = apply_result(plan, fills[i, :k], tokens[i, :k])
            if was_prefill and seq.decode_started is None:  # the prompt, not a rebuild
                seq.prefill_started = seq.prefill_started or started
                seq.prefill_s = done_at - seq.prefill_started
            else:
                seq.decode_started = seq.decode_started or started
                seq.decode_s = done_at - seq.decode_started
            if was_prefill and seq.phase is Phase.DECODE:
                min(self.groups, key=len).append(seq)
            if new or seq.finished:
                commits.append(Commit(seq, new))
        return commits

    def reap(self, in_flight: set[int]) -> list[Sequence]:
        """Drop finished sequences that no forward in flight includes; their KV can go."""
        done = [s for s in self.running if s.finished and s.seq_id not in in_flight]
        gone = {s.seq_id for s in done}
        if gone:
            self.running = [s for s in self.running if s.seq_id not in gone]
            self.groups = [[s for s in group if s.seq_id not in gone] for group in self.groups]
        self._rebalance()
        return done

    def _rebalance(self) -> None:
        """Keep groups within one sequence of each other (moves cost a KV copy, so only
        when the gap is larger than that)."""
        idle = [g for g in range(self.groups_count) if g not in self.busy]
        if len(idle) < 2:
            return
        big = max(idle, key=lambda g: len(self.groups[g]))
        small = min(idle, key=lambda g: len(self.groups[g]))
        if len(self.groups[big]) - len(self.groups[small]) > 1:
            self.groups[small].append(self.groups[big].pop())

    def fail_all(self) -> list[Sequence]:
        failed = [s for s in self.running if not s.finished]
        for seq in failed:
            seq.finish_reason = "error"
            seq.phase = Phase.FINISHED
        self.running, self.busy = [], set()
        self.groups = [[] for _ in range(self.groups_count)]
        return failed
