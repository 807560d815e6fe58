"""The decoding engine. A tick (`step`) is schedule → run → postprocess: launch micro-batches
until P are in flight, complete the oldest one (its layers, then the head, selection and
sampling with one host sync; a look-ahead forward is launched inside), and hand its results
to the scheduler, the only owner of sequence state. What differs between decoding modes is
asked of the row's mode (coordinator/engine/modes/): the engine holds no mode checks. It
owns MLX in its process: call it from one thread."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace

import mlx.core as mx
import numpy as np

from common.layer_runner import select_slots
from common.model_parts import ModelParts
from coordinator.engine import constrained, head_choice, modes, token_logprobs
from coordinator.engine.engine_recovery import EngineRecovery
from coordinator.engine.engine_requests import EngineRequests
from coordinator.engine.forward_clock import ForwardClock
from coordinator.engine.forward_shapes import ForwardShapes, ShapeLimits
from coordinator.engine.grammar_fills import GrammarFills
from coordinator.engine.in_flight import InFlight, Ran
from coordinator.engine.look_ahead import LookAhead
from coordinator.engine.modes import PlanContext
from coordinator.engine.modes.speculative import with_model_drafts
from coordinator.engine.padding_rows import PaddingRows
from coordinator.engine.pipeline import Pipeline
from coordinator.engine.prefix_cache import PrefixCache, count_late_rows
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.scheduler import PREFILL, Commit, Limits, Scheduler, Unit
from coordinator.engine.sequence import Sequence
from coordinator.engine.step_cost import StepCost
from coordinator.engine.tick_batch import TickBatch, build_batch

__all__ = ["Commit", "Engine", "InFlight", "Limits", "Ran"]


class Engine(EngineRequests, EngineRecovery):
    def __init__(
        self,
        parts: ModelParts,
        pipeline: Pipeline,
        num_rows: int,
        text_tail: Callable[[list[int]], str] | None = None,
        stop_ids: tuple[int, ...] = (),
        micro_batches: int = 1,
        limits: Limits | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.parts = parts
        self.config = parts.config
        self.pipeline = pipeline
        self.text_tail = text_tail
        self.micro_batches = micro_batches
        limits = replace(limits or Limits(), max_running=num_rows)
        self.prefill_chunk = limits.prefill_chunk
        self.scheduler = self._new_scheduler(limits, micro_batches, prefix_cache)
        if prefix_cache is not None and getattr(parts, "recurrent", False):
            prefix_cache.forks_anywhere = False  # a state forks only where it was left
        self.in_flight: deque[InFlight] = deque()
        self._ids = itertools.count()
        self._batch_ids = itertools.count(1)
        self.padding = PaddingRows()
        # The model's EOS ids and the tokenizer's chat end tokens always stop.
        self.model_stop_ids = tuple(dict.fromkeys(self.config.eos_token_ids + tuple(stop_ids)))
        self.forwards = 0
        # decode micro-batches with a speculative row, and of those the drafting ones (a
        # row with drafts or mask slots: the whole forward is as wide; draft_policy.py)
        self.speculative_batches = 0
        self.drafting_batches = 0
        self.clock = ForwardClock()
        self.shapes = ForwardShapes()  # distinct forward shapes launched (bounded: shape_limits)
        self.undelivered: list[Commit] = []  # commits of a step that then failed
        self.drafter = None  # a DraftModel proposing speculative drafts (use_drafter)
        self._init_requests()
        self.fills = GrammarFills(self.config.vocab_size)  # structured output's masks
        # True: constrained WeDLM rows are launched ahead too (the look-ahead is dropped when
        # the grammar cuts a run it was built from); False (the default, GC2: +32.6 %
        # against +23.6 % at C = 32, the drops cost more than the overlap saved): never.
        self.constrained_ahead = False
        # True: a speculative drafting spell's next forward is built on the device and
        # launched before the read-back (modes/speculative.py). Off by default: on an H100
        # a chained forward took 7.8 ms against 9.2 read back first, but some took ~85 ms
        # (RESULTS.md SC8), which priced drafts out online
        self.speculative_ahead = False
        self.ahead_dropped = 0  # look-ahead forwards dropped (LookAhead.drop), for benchmarks
        self.speculative_chained = 0  # speculative forwards built on the device, ahead
        self.ahead = LookAhead(self)

    def _new_scheduler(
        self, limits: Limits, micro_batches: int, prefix_cache: PrefixCache | None
    ) -> Scheduler:
        """The owner of this engine's sequence state."""
        config = self.config
        return Scheduler(
            limits,
            micro_batches,
            config.mask_token_id,
            config.max_position_embeddings,
            cache=prefix_cache,
        )

    def use_pipeline(self, pipeline: Pipeline, micro_batches: int) -> None:
        """Switch to another pipeline (e.g. once the workers are planned). Call while idle."""
        assert not self.in_flight and not self.running, "the engine is busy"
        cached = self.scheduler.drop_cache()  # the new stages may split the layers otherwise
        if cached:
            self.pipeline.release(cached)
        self.pipeline = pipeline
        self.micro_batches = micro_batches
        self.scheduler.regroup(micro_batches)
        self.padding.take_all()

    @property
    def step_cost(self) -> StepCost:
        """The break-even of speculative drafts on this machine (step_cost.py)."""
        return self.scheduler.step_cost

    @property
    def limits(self) -> Limits:
        """What bounds admission and forwards (read it; change it with change_limits)."""
        return self.scheduler.limits

    def change_limits(self, **changes) -> None:
        self.scheduler.change_limits(**changes)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache()

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running_now()

    @property
    def waiting(self) -> list[Sequence]:
        return self.scheduler.waiting_now()

    @property
    def grammars(self) -> constrained.Grammars | None:
        return self.fills.grammars

    def use_grammars(self, grammars: constrained.Grammars) -> None:
        """Decode requests with a grammar (structured output) through these matchers."""
        self.fills.grammars = grammars

    @property
    def fill_ahead(self) -> bool:
        """Grammar masks filled on the grammars' thread (grammar_fills.py); off: inline."""
        return self.fills.fill_ahead

    @fill_ahead.setter
    def fill_ahead(self, on: bool) -> None:
        self.fills.fill_ahead = on

    def use_drafter(self, drafter) -> None:
        """Propose speculative drafts with this DraftModel (draft source "model")."""
        self.drafter = drafter

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Finish a sequence now; its KV is released once no forward of it is in flight."""
        self.scheduler.cancel(seq, reason)

    def fail(self, seqs: list[Sequence]) -> None:
        """Finish these sequences with an error (the engine thread ends)."""
        self.scheduler.fail(seqs)

    @property
    def has_work(self) -> bool:
        return bool(self.in_flight) or self.scheduler.has_work()

    # ---- one tick -------------------------------------------------------------------
    def step(self) -> list[Commit]:
        """One tick: schedule, run, postprocess. Commits of sequences whose last tokens
        were known without a forward survive a failure (`take_undelivered`)."""
        commits: list[Commit] = []
        try:
            self._schedule(commits)
            ran = self._complete(commits) if self.in_flight else None
        except Exception:
            self.undelivered += commits
            raise
        if ran is not None:
            commits += self._postprocess(ran)
        token_logprobs.attach(commits)
        self._retire()
        return commits

    def _schedule(self, commits: list[Commit]) -> None:
        """Admit waiting sequences, then launch micro-batches until P are in flight."""
        self.scheduler.admit()
        while len(self.in_flight) < self.micro_batches:
            picked = self.scheduler.next_micro_batch(commits)
            if picked is None:
                return
            self._launch(*picked)

    def _postprocess(self, ran: Ran) -> list[Commit]:
        flight = ran.flight
        if getattr(self.parts, "recurrent", False):
            count_late_rows(flight.plans)
        before = [len(p.seq.output) for p in flight.plans]
        window_steps = token_logprobs.wedlm_decoding(flight.plans)
        commits = self.scheduler.postprocess(
            flight.unit, flight.plans, ran.fills, ran.tokens, flight.started, ran.ahead
        )
        self.fills.advance(flight.plans, before)
        if ran.logprobs is not None:
            token_logprobs.record(
                ran.logprobs, flight.plans, before, ran.tokens, ran.fills, window_steps
            )
        if ran.prompt_scores is not None:
            token_logprobs.record_prompt(ran.prompt_scores, flight.plans)
        if ran.ahead and self.in_flight and self.in_flight[-1].unresolved:
            ahead = self.in_flight[-1]
            if self.fills.cut & {p.seq.seq_id for p in ahead.plans}:
                self.ahead.drop(ahead)
            else:
                self.ahead.resolve(ahead, commits)
        self.fills.start(self.in_flight)  # the next forward's matchers took this one's tokens
        return commits

    def _retire(self) -> None:
        """Finished sequences that no forward in flight includes leave; their KV rows go
        to the prefix cache or are released."""
        done = self.scheduler.reap({p.seq.seq_id for f in self.in_flight for p in f.plans})
        gone = self.scheduler.retire(done)
        if gone:  # their ids are never used again: the workers may drop them at leisure
            self.pipeline.release(gone, wait=False)
        if done and self.drafter is not None:
            self.drafter.release([s.seq_id for s in done])

    def _launch(self, unit: Unit, plans: list[RowPlan]) -> None:
        started = time.perf_counter()
        if self.drafter is not None:  # rows drafting with the draft model get its proposals
            plans = with_model_drafts(plans, self.drafter, self._plan_context(len(plans)))
        batch = build_batch(plans, padding_ids=self._padding_ids(unit, len(plans)))
        hidden = self.parts.embed(mx.array(batch.tokens))
        batch_id = self._submit(batch.spec, hidden, batch.reply_slots())
        for plan in plans:  # the stages copy cached rows as this forward reaches them
            if plan.seq.prefix is not None:
                plan.seq.prefix.sent = True
        self.in_flight.append(InFlight(batch_id, unit, plans, batch, started))
        self.fills.start(self.in_flight)

    def _submit(self, spec, hidden: mx.array, reply_slots: np.ndarray | None = None) -> int:
        batch_id = next(self._batch_ids)
        if self.shapes.record(spec):  # its first run compiles: no measure of a step's cost
            self.clock.compiling.add(batch_id)
        self.pipeline.submit(batch_id, spec, hidden, reply_slots)
        return batch_id

    def _plan_context(self, rows: int) -> PlanContext:
        config = self.config
        return PlanContext(
            config.mask_token_id,
            config.max_position_embeddings,
            self.prefill_chunk,
            self.step_cost.break_even(rows),
        )

    def drop_padding(self) -> None:
        """Release every padding row (while idle): the next batches make their own."""
        stale = self.padding.take_all()
        if stale:
            self.pipeline.release(stale)

    def _padding_ids(self, unit: Unit, rows: int) -> list[int]:
        return self.padding.ids_for(unit, rows, lambda s: self.pipeline.release(s, wait=False))

    def _complete(self, commits: list[Commit]) -> Ran | None:
        """Run the oldest micro-batch to its tokens: collect its hidden states, head,
        selection and sampling, one host sync. The next forward goes to the device before
        the sync (a mode's look-ahead, or another unit's micro-batch)."""
        self.fills.start(self.in_flight)
        flight = self.in_flight.popleft()
        fill = self.fills.take(flight.batch_id)
        batch_id, hidden = self.pipeline.collect()
        assert batch_id == flight.batch_id, "micro-batches complete in order"
        if flight.dropped:  # its unit launches again from the cut windows
            self.clock.compiling.discard(flight.batch_id)
            self.scheduler.ahead_dropped(flight.unit)
            self._schedule(commits)
            return self._complete(commits) if self.in_flight else None
        if flight.unresolved:  # a look-ahead forward returned every slot
            rows = len(flight.plans)
            hidden = select_slots(hidden[:rows], flight.batch.head_slots)
        scores = None
        if not flight.unresolved and flight.batch.score_slots.shape[1]:
            # prompt rows scored for prompt logprobs: every slot came back (reply_slots)
            k, rows = flight.batch.head_slots.shape[1], len(flight.plans)
            hidden = select_slots(hidden[:rows], flight.batch.wanted_slots())
            scores = token_logprobs.prompt_scores(
                flight.plans, flight.batch.score_slots, hidden[:, k:], self.parts.head
            )
            hidden = hidden[:, :k]
        fills, tokens, logprobs = self._select(flight.batch, hidden, fill)
        # Queue this step's selection before the look-ahead forward: the device runs its
        # work in order, so the sync below then waits for step t only, not for t+1.
        extra = logprobs.arrays() if logprobs is not None else []
        extra += scores.arrays() if scores is not None else []
        mx.async_eval(fills, tokens, *extra)
        ahead = self._launch_ahead(flight, fills, tokens)
        if not ahead:
            self._launch_other(commits)
        mx.eval(fills, tokens, *extra)  # the one host sync of this micro-batch
        host_tokens = np.array(tokens)
        if ahead and not self.in_flight[-1].unresolved:
            self.fills.fill_early(flight, self.in_flight, host_tokens)
        self.forwards += 1
        self.clock.observe(self.step_cost, flight, self.micro_batches)
        self._count_batch(flight)
        return Ran(flight, np.array(fills), host_tokens, ahead, logprobs, scores)

    def _launch_ahead(self, flight: InFlight, fills: mx.array, tokens: mx.array) -> bool:
        """The unit's next forward before this step's read-back, where a row's mode can
        build it (look_ahead.py)."""
        return self.ahead.launch(flight, fills, tokens)

    def _select(
        self, batch: TickBatch, hidden: mx.array, fill: Future[constrained.Masks] | None = None
    ) -> tuple[mx.array, mx.array, token_logprobs.SlotLogprobs | None]:
        """Head, selection and sampling on the device, left lazy (head_choice.py)."""
        return head_choice.select(self.parts.head, batch, hidden, self.grammars, fill)

    def _count_batch(self, flight: InFlight) -> None:
        drafting = [p for p in flight.plans if modes.mode_of(p.seq.params.mode).drafting(p)]
        if drafting and flight.unit is not PREFILL and not flight.unresolved:
            self.speculative_batches += 1
            self.drafting_batches += any(p.width > p.keep for p in drafting)

    def _launch_other(self, commits: list[Commit]) -> None:
        """Another unit's micro-batch (a prompt chunk, another group) does not depend on
        the one being completed: launch it now, so the device has work while the host reads
        and postprocesses that one (whose unit stays busy until postprocess)."""
        if len(self.in_flight) < self.micro_batches:
            picked = self.scheduler.next_micro_batch(commits)
            if picked is not None:
                self._launch(*picked)

    def shape_limits(self) -> ShapeLimits:
        """What bounds this engine's forward shapes (`shape_limits().bound()` counts them)."""
        return self.scheduler.shape_limits()

    def stream(self, seqs: list[Sequence]) -> Iterator[Commit]:
        """Tick until these sequences finish, yielding their commits as they happen."""
        wanted = {s.seq_id for s in seqs}
        while any(not s.finished for s in seqs):
            for c in self.step():
                if c.seq.seq_id in wanted:
                    yield c

