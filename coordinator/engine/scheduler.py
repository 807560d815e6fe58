"""Which sequences run in the next micro-batch, and the one place their state changes.

Decode sequences live in P stable groups (one micro-batch each), so the workers' KV batches
keep their membership from tick to tick; a sequence joins the least-loaded group when its
prefill ends. Prefill runs as its own micro-batches, in chunks, taking turns with the
decode groups, so a long new prompt never stalls running streams.

A prefill forward costs about as much as a decode step wherever a forward is bound by reading
the weights or by launching kernels, whatever few prompt rows it carries. So while sequences
decode, a new prompt may wait up to `prefill_hold` decode steps for others to share its
prefill forward (`prefill_batch` prompts start one at once), as TGI's router waits
`max_waiting_tokens` steps: arrivals in a busy server then cost one forward per batch of
prompts instead of one each. Nothing waits when nothing decodes, and a prompt already under
way (a long one in chunks, a history being rebuilt) is never held.

Whether a decode micro-batch's speculative rows carry drafts is decided for the whole
micro-batch (draft_policy.batch_rooms): one drafting row makes every row's forward a
drafting one."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from common.generation_params import MAX_FORWARD_ROWS
from coordinator.engine.draft_policy import batch_rooms
from coordinator.engine.forward_shapes import ShapeLimits, padded_width, row_bucket
from coordinator.engine.limits import Limits
from coordinator.engine.modes import PlanContext, apply_result, plan_next
from coordinator.engine.prefix_cache import PrefixCache
from coordinator.engine.prompt_sharing import forked, leaders_in_use, start_shared, waits
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Phase, Sequence
from coordinator.engine.step_cost import StepCost
from coordinator.engine.tick_types import PREFILL, Commit, QueueFull, Unit

__all__ = ["PREFILL", "Commit", "Limits", "QueueFull", "Scheduler", "Unit"]


@dataclass
class Scheduler:
    limits: Limits
    groups_count: int
    mask_token_id: int
    max_positions: int
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    groups: list[list[Sequence]] = field(default_factory=list)
    busy: set[Unit] = field(default_factory=set)  # units with a micro-batch in flight
    cache: PrefixCache | None = None  # finished sequences' KV rows, reused by new prompts
    decode_forwards: int = 0  # decode micro-batches completed (the clock of prefill_hold)
    # n > 1 choices fork their leader's prompt rows (prompt_sharing.py)
    shares_prompts: ClassVar[bool] = True
    # what a drafting forward costs in AR forwards: the break-even of speculative drafts
    step_cost: StepCost = field(default_factory=StepCost)
    _turn: int = 0
    _held_since: dict[int, int] = field(default_factory=dict)  # seq id → decode_forwards

    def __post_init__(self) -> None:
        self.groups = [[] for _ in range(self.groups_count)]

    def change_limits(self, **changes) -> None:
        """The service's one way to change limits (a measured KV budget, the rows run at
        once that follow it): the scheduler owns them."""
        for name, value in changes.items():
            if not hasattr(self.limits, name):
                raise AttributeError(f"Limits has no field {name!r}")
            setattr(self.limits, name, value)

    # ---- what the engine and the service read ---------------------------------------
    def has_work(self) -> bool:
        """Whether a sequence waits or runs (finished ones run until reaped)."""
        return bool(self.waiting or self.running)

    def running_now(self) -> list[Sequence]:
        """The admitted sequences, until reaped (a copy)."""
        return list(self.running)

    def waiting_now(self) -> list[Sequence]:
        """The queued sequences, oldest first (a copy)."""
        return list(self.waiting)

    def row_ids(self) -> list[int]:
        """The ids of the admitted sequences: the KV rows the stages hold for them."""
        return [s.seq_id for s in self.running]

    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache in use (None: off, or paused for a warm-up)."""
        return self.cache

    def shape_limits(self) -> ShapeLimits:
        """What bounds the forwards this scheduler plans: its rows, a prompt chunk or a
        window, and the model's context."""
        return ShapeLimits(
            max_rows=self.limits.max_running,
            max_width=max(self.limits.prefill_chunk, MAX_FORWARD_ROWS),
            max_positions=self.max_positions,
        )

    # ---- requests ------------------------------------------------------------------
    def kv_need(self, seq: Sequence) -> int:
        """Worst-case KV rows of a sequence: its prompt, every token it may commit, the
        rows a forward writes past the committed length, and its recurrent state's fixed
        cost (in KV rows' worth of memory; 0 for attention-only families)."""
        rows = len(seq.prompt) + seq.params.max_tokens + seq.params.forward_rows
        return rows + self.limits.state_tokens

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
            own = not seq.rebuild_to and seq.share_from is None  # prompt_sharing: its fork
            # prompt logprobs need every prompt row's logits: no cached rows skip them
            own = own and not seq.params.prompt_logprobs
            hit = cache.find(seq.prompt) if cache is not None and own else None
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
            if cache is not None and own:
                cache.stats.lookups += 1
                if hit is not None:
                    cache.take(hit)
                    seq.start_from(hit)
            seq.phase = Phase.PREFILL
            self._held_since[seq.seq_id] = self.decode_forwards
            self.running.append(seq)

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Abort a sequence (`reason`: its finish reason, e.g. "deadline")."""
        if seq.finished:
            return
        seq.abort_reason = reason
        seq.phase = Phase.ABORTED
        if seq in self.waiting:
            self.waiting.remove(seq)

    def regroup(self, groups_count: int) -> None:
        """Start over with this many empty decode groups and nothing in flight (a new
        pipeline; call while no sequence decodes, or after `restart`)."""
        self.groups_count = groups_count
        self.groups = [[] for _ in range(groups_count)]
        self.busy.clear()

    def restart(self, groups_count: int) -> None:
        """Every running sequence re-prefills its committed history on a new pipeline with
        this many decode groups (the forwards in flight are gone)."""
        for seq in self.running:
            seq.restart_prefill()
            if not seq.finished:
                seq.phase = Phase.PREFILL
        self.regroup(groups_count)

    # ---- forming micro-batches -------------------------------------------------------
    def units(self) -> list[Unit]:
        return [PREFILL, *range(self.groups_count)]

    def next_micro_batch(self, commits: list[Commit]) -> tuple[Unit, list[RowPlan]] | None:
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

    def _plans(self, unit: Unit, commits: list[Commit]) -> list[RowPlan]:
        if unit is PREFILL:
            return self._prefill_plans()
        plans = []
        live = [s for s in self.groups[unit] if not s.finished]
        # whether the micro-batch drafts is decided for all its rows (draft_policy.py)
        rooms = batch_rooms(live, self.step_cost.break_even(len(live)))
        for seq, room in zip(live, rooms, strict=True):
            plan = self.plan_or_finish(seq, commits, room)
            if plan is not None:
                plans.append(plan)
        return plans

    def plan_or_finish(
        self, seq: Sequence, commits: list[Commit], room: int | None = None
    ) -> RowPlan | None:
        """`seq`'s next row plan, or None when it finishes without a forward: the tokens
        that end it are known, or its next window would pass the context. `room`: the
        drafts its batch lets a speculative row carry (None: its own draft room)."""
        plan = self.plan(seq, room)
        if plan.commits and seq.ending(plan.commits)[1] is not None:
            before = len(seq.output)
            seq.phase = seq.commit(plan.commits)
            commits.append(Commit(seq, seq.output[before:]))
            return None
        if seq.kv_length + plan.width > self.max_positions:
            seq.phase = Phase.LENGTH
            commits.append(Commit(seq, []))
            return None
        return plan

    def plan(self, seq: Sequence, room: int | None = None) -> RowPlan:
        """What `seq` contributes to its next forward (a decoding strategy's rule)."""
        limits = self.limits
        rows = -(-len(self.running) // max(self.groups_count, 1))  # a decode group's size
        break_even = self.step_cost.break_even(rows)
        ctx = PlanContext(self.mask_token_id, self.max_positions, limits.prefill_chunk, break_even)
        return plan_next(seq, ctx, room)

    def apply(self, plan: RowPlan, row: int, fills, tokens, rows: int = 1) -> list[int]:
        """Apply row `row` of a forward of `rows` sequences to its sequence; the new tokens."""
        k = plan.head_slots.size
        break_even = self.step_cost.break_even(rows)
        new, plan.seq.phase = apply_result(plan, fills[row, :k], tokens[row, :k], break_even)
        return new

    def prefill_pending(self) -> list[Sequence]:
        """Sequences with prompt rows to run now (not those waiting for their leader's
        prompt rows: prompt_sharing.py)."""
        pending = [s for s in self.running if s.phase is Phase.PREFILL and not s.finished]
        if any(s.share_from is not None for s in pending):
            running = {s.seq_id for s in self.running}
            pending = [s for s in pending if not waits(s, running)]
        return pending

    def prefill_ready(self) -> bool:
        """Whether a prefill micro-batch should run now (module docstring: the hold)."""
        pending = self.prefill_pending()
        if not pending:
            return False
        limits = self.limits
        if limits.prefill_hold <= 0 or len(pending) >= limits.prefill_batch:
            return True
        if any(s.rebuild_to or s.prefilled > s.cached_tokens for s in pending):
            return True  # under way: a long prompt's next chunk, or a rebuild after a fault
        if any(s.share_from is not None for s in pending):
            return True  # a choice whose leader's prompt is in: its stream runs already
        decoding = sum(any(not s.finished for s in group) for group in self.groups)
        if not decoding:
            return True  # nobody decodes: waiting would delay everyone and save nothing
        rows = sum(len(s.prefill_tokens()) - s.prefilled for s in pending)
        if rows >= limits.prefill_budget:
            return True  # a full prefill forward already
        # each decoding group's forward advances the clock: a step is one forward of each
        oldest = min(self._held_since.get(s.seq_id, 0) for s in pending)
        return self.decode_forwards - oldest >= limits.prefill_hold * decoding

    def _prefill_plans(self) -> list[RowPlan]:
        plans: list[RowPlan] = []
        if not self.prefill_ready():
            return plans
        width = 0
        running = {s.seq_id for s in self.running}
        for seq in self.prefill_pending():
            start_shared(seq, running)
            plan = self.plan(seq)
            # the forward's size once padded (forward_shapes): it stays within the budget
            padded = padded_width(max(width, plan.width)) * row_bucket(len(plans) + 1)
            if plans and padded > self.limits.prefill_budget:
                break
            plans.append(plan)
            width = max(width, plan.width)
        return plans

    # ---- the only place sequences change state ---------------------------------------
    def postprocess(
        self, unit: Unit, plans: list[RowPlan], fills, tokens, started: float, ahead: bool
    ) -> list[Commit]:
        """`started`: when this forward's launch began (wall times are spans from the
        first launch, so overlapping forwards are not counted twice). `ahead`: the unit's
        next forward is in flight already (the look-ahead), so it stays busy."""
        if not ahead:
            self.busy.discard(unit)
        if unit is not PREFILL:
            self.decode_forwards += 1
        commits = []
        done_at = time.perf_counter()
        for i, plan in enumerate(plans):
            seq = plan.seq
            if seq.finished:  # cancelled while its forward was in flight
                continue
            was_prefill = seq.phase is Phase.PREFILL
            new = self.apply(plan, i, fills, tokens, len(plans))
            if was_prefill and seq.decode_started is None:  # the prompt, not a rebuild
                seq.prefill_started = seq.prefill_started or started
                seq.prefill_s = done_at - seq.prefill_started
            else:
                seq.decode_started = seq.decode_started or started
                seq.decode_s = done_at - seq.decode_started
            if was_prefill and seq.phase is Phase.DECODE:
                min(self.groups, key=len).append(seq)
                self._held_since.pop(seq.seq_id, None)
            if new or seq.finished:
                commits.append(Commit(seq, new))
            forked(seq)
        self._unpin_forks(plans)
        return commits

    def _unpin_forks(self, plans: list[RowPlan]) -> None:
        """Every stage has run these forwards: their forks' sources may be evicted now."""
        if self.cache is not None:
            for plan in plans:
                if plan.seq.prefix is not None and plan.seq.prefix.pinned:
                    self.cache.unpin(plan.seq.prefix)

    # ---- the look-ahead (engine._launch_ahead) ---------------------------------------
    def ahead_dropped(self, unit: Unit) -> None:
        """A look-ahead forward of `unit` went stale before its plans were named (a
        grammar cut a window's run: engine._drop_ahead) and is discarded: the unit is
        free for a regular launch."""
        self.busy.discard(unit)

    def joiners(self, unit: Unit, plans: list[RowPlan]) -> list[Sequence] | None:
        """The sequences of decode group `unit` that joined it since `plans` were made
        (their prefill ended), or None when a row of `plans` left the group."""
        group = [s for s in self.groups[unit] if not s.finished]
        running = {p.seq.seq_id for p in plans}
        if not running <= {s.seq_id for s in group}:
            return None
        return [s for s in group if s.seq_id not in running]

    def other_work(self, unit: Unit) -> bool:
        """Whether a prefill or another idle group with work waits for a launch slot
        (new prompts that are held do not count)."""
        if self.prefill_ready():
            return True
        return any(
            g != unit and g not in self.busy and any(not s.finished for s in group)
            for g, group in enumerate(self.groups)
        )

    # ---- finished sequences ------------------------------------------------------------
    def retire(self, done: list[Sequence]) -> list[int]:
        """Hand reaped sequences' KV rows to the prefix cache; returns the ids whose rows
        the stages may drop (not kept, or evicted for room)."""
        cache = self.cache
        if cache is None:
            return [s.seq_id for s in done]
        untrusted = []
        for seq in done:
            if seq.prefix is not None:
                cache.unpin(seq.prefix)
            tokens = seq.cacheable()
            if tokens is None:
                untrusted.append(seq.seq_id)
            else:
                cache.insert(seq.seq_id, tokens, self.limits.kv_tokens)
        return untrusted + cache.take_dropped()

    def drop_cache(self) -> list[int]:
        """Forget the prefix cache; returns the ids whose rows stages may still hold."""
        return self.cache.clear() if self.cache is not None else []

    def reap(self, in_flight: set[int]) -> list[Sequence]:
        """Drop finished sequences that no forward in flight includes; their KV can go."""
        # a leader stays while a choice still forks its prompt rows (prompt_sharing.py)
        keep = in_flight | leaders_in_use(self.running, in_flight)
        done = [s for s in self.running if s.finished and s.seq_id not in keep]
        gone = {s.seq_id for s in done}
        if gone:
            self.running = [s for s in self.running if s.seq_id not in gone]
            for seq_id in gone:
                self._held_since.pop(seq_id, None)
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

    def requeue_running(self) -> list[Sequence]:
        """Every unfinished running sequence back to the front of the queue, in order, to
        rebuild its KV from its tokens when admission lets it in again (a forward ran out
        of memory: the budget shrank, fewer may run at once). Returns them."""
        back = [s for s in self.running if not s.finished]
        for seq in back:
            seq.restart_prefill()
            seq.phase = Phase.WAITING
        self.waiting.extendleft(reversed(back))
        self.running = [s for s in self.running if s.finished]  # reaped as usual
        self._held_since.clear()
        self.regroup(self.groups_count)
        return back

    def fail(self, seqs: list[Sequence]) -> None:
        """Finish these (running or waiting) sequences with an error."""
        for seq in seqs:
            seq.phase = Phase.ERROR
            if seq in self.waiting:
                self.waiting.remove(seq)

    def fail_all(self) -> list[Sequence]:
        failed = [s for s in self.running if not s.finished]
        for seq in failed:
            seq.phase = Phase.ERROR
        self.running = []
        self._held_since.clear()
        self.regroup(self.groups_count)
        return failed
