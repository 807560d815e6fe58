"""The decoding engine. A tick (`step`) launches micro-batches until P are in flight
(schedule), completes the oldest one (run: the layers, then the head, selection and
sampling with one host sync; the look-ahead forward is launched inside) and hands its
results to the scheduler (postprocess), the only owner of sequence state. The engine calls
the scheduler's methods and never changes its fields. It owns MLX in its process: call it
from one thread."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from common.errors import InvalidRequest, PromptTooLong
from common.generation_params import GenerationParams
from common.layer_runner import select_slots
from common.model_parts import ModelParts
from common.modes import Mode
from common.rows_spec import RowsSpec
from common.window_mask import compiled_device_visibility
from coordinator.engine import constrained, logit_bias, speculative_ahead, token_logprobs
from coordinator.engine.ar_ahead import ar_decoding, next_plans, speculative
from coordinator.engine.auto_mode import family_mode, refused_mode
from coordinator.engine.forward_shapes import ForwardShapes, ShapeLimits, padded_width, row_bucket
from coordinator.engine.pipeline import Pipeline
from coordinator.engine.prefix_cache import PrefixCache, count_late_rows
from coordinator.engine.prompt_sharing import can_share
from coordinator.engine.row_plan import (
    RowPlan,
    draft_room,
    plan_autoregressive,
    plan_speculative,
)
from coordinator.engine.sampling import greedy_tokens, sample_tokens
from coordinator.engine.scheduler import PREFILL, Commit, Limits, Scheduler, Unit
from coordinator.engine.selection import eager_window_fills, window_fills
from coordinator.engine.sequence import Phase, Sequence
from coordinator.engine.step_cost import AR, DRAFT, StepCost
from coordinator.engine.tick_batch import TickBatch, build_batch
from coordinator.engine.wedlm_ahead import next_inputs

__all__ = ["Commit", "Engine", "Limits"]
log = logging.getLogger(__name__)


@dataclass
class InFlight:
    batch_id: int
    unit: Unit
    plans: list[RowPlan]
    batch: TickBatch | None  # None until _resolve_ahead names an unresolved forward's plans
    started: float
    # A WeDLM look-ahead forward (wedlm_ahead.py): launched before its rows were known to
    # the host; its plans are named by `_resolve_ahead`, and the pipeline returns every
    # slot's hidden state (the head slots are taken once they are known).
    unresolved: bool = False
    # A look-ahead forward whose inputs went stale (_drop_ahead): read back and discarded.
    dropped: bool = False
    # a speculative look-ahead forward (speculative_ahead.py): its rows' width and the
    # most drafts each row carries
    width: int = 0
    caps: list[int] | None = None


@dataclass
class Ran:
    """A completed micro-batch's results on the host, for postprocess."""

    flight: InFlight
    fills: object  # [B, K] bool (a diffusion engine: its per-row CanvasResults)
    tokens: object  # [B, K] int (a diffusion engine: None)
    ahead: bool  # its unit's next forward was launched ahead
    logprobs: token_logprobs.SlotLogprobs | None = None  # for the rows that ask
    prompt_scores: token_logprobs.PromptScores | None = None  # params.prompt_logprobs rows


class Engine:
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
        self._padding: dict[int, set[int]] = {}  # padding rows each unit holds on the workers
        # The model's EOS ids and the tokenizer's chat end tokens always stop.
        self.model_stop_ids = tuple(dict.fromkeys(self.config.eos_token_ids + tuple(stop_ids)))
        self.forwards = 0
        # decode micro-batches with a speculative row, and of those the drafting ones (a
        # row with drafts or mask slots: the whole forward is as wide; draft_policy.py)
        self.speculative_batches = 0
        self.drafting_batches = 0
        self._last_done = 0.0  # when the last forward was read back (step_cost's clock)
        self.shapes = ForwardShapes()  # distinct forward shapes launched (bounded: shape_limits)
        self.undelivered: list[Commit] = []  # commits of a step that then failed
        self.drafter = None  # a DraftModel proposing speculative drafts (use_drafter)
        self._warned: set[str] = set()  # modes whose mode_warning was logged
        self._auto_mode: str | None = None  # mode "auto" decodes with this (None: the model's)
        self.grammars: constrained.Grammars | None = None  # structured output (use_grammars)
        # True: the mask fill of the oldest forward in flight starts on the grammars'
        # thread once its matchers are advanced (_start_fill); False (the default): filled
        # inline in _choose. On an H100 (RESULTS.md GC2) the thread cost more than it hid:
        # AR at C = 32 +16.9 % against +1.0 % inline.
        self.fill_ahead = False
        self._fill: tuple[int, Future[constrained.Masks]] | None = None
        # True: constrained WeDLM rows are launched ahead too (the look-ahead is dropped when
        # the grammar cuts a run it was built from); False (the default, GC2: +32.6 %
        # against +23.6 % at C = 32, the drops cost more than the overlap saved): never.
        self.constrained_ahead = False
        # True: a speculative drafting spell's next forward is built on the device and
        # launched before the read-back (speculative_ahead.py). Off by default: on an H100
        # a chained forward took 7.8 ms against 9.2 read back first, but some took ~85 ms
        # (RESULTS.md SC8), which priced drafts out online
        self.speculative_ahead = False
        self._cut: set[int] = set()  # sequences whose run the grammar cut at the last step
        self._taken: dict[int, int] = {}  # seq id -> the token its matcher took early
        self.ahead_dropped = 0  # look-ahead forwards dropped (_drop_ahead), for benchmarks
        self.speculative_chained = 0  # speculative forwards built on the device, ahead
        self._compiling: set[int] = set()  # forwards of a shape new to this engine

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
        cached = self._drop_cache()  # the new stages may split the layers differently
        if cached:
            self.pipeline.release(cached)
        self.pipeline = pipeline
        self.micro_batches = micro_batches
        self.scheduler.regroup(micro_batches)
        self._padding.clear()

    @property
    def step_cost(self) -> StepCost:
        """The break-even of speculative drafts on this machine (step_cost.py)."""
        return self.scheduler.step_cost

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache()

    def _drop_cache(self) -> list[int]:
        """Forget the prefix cache; returns the ids whose rows stages may still hold."""
        return self.scheduler.drop_cache()

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running_now()

    @property
    def waiting(self) -> list[Sequence]:
        return self.scheduler.waiting_now()

    # ---- requests -------------------------------------------------------------------
    @property
    def default_mode(self) -> str:
        """What requests in mode "auto" decode with: the checkpoint's own decoding, unless
        this machine's measured costs chose otherwise (auto_mode.py: `use_auto_mode`)."""
        recurrent = getattr(self.parts, "recurrent", False)
        return self._auto_mode or family_mode(self.config.default_mode, recurrent)

    def use_auto_mode(self, mode: str | None) -> None:
        """Mode "auto" decodes with `mode` from now on (None: the checkpoint's own)."""
        self._auto_mode = mode

    def resolve_mode(self, params: GenerationParams) -> GenerationParams:
        """Mode "auto" becomes this engine's own decoding."""
        return replace(params, mode=self.default_mode) if params.mode == Mode.AUTO else params

    def mode_warning(self, params: GenerationParams) -> str:
        """Why a request's (resolved) decoding may give degraded text on this checkpoint:
        WeDLM windows or mask-slot drafts on a model that never learned mask slots."""
        masks = params.mode == Mode.WEDLM or params.draft == "mask"
        if not masks or self.config.wedlm_trained:
            return ""
        what = "mode wedlm" if params.mode == Mode.WEDLM else "mask-slot drafts"
        return (
            f"{what} on a checkpoint that is not WeDLM-trained ({self.config.model_type}, no "
            f"'wedlm' record in config.json): its mask slots were never trained, expect "
            f"degraded text (mode auto decodes it with {self.default_mode})"
        )

    def submit(
        self, prompt: list[int], params: GenerationParams, shares_with: Sequence | None = None
    ) -> Sequence:
        """`shares_with`: another choice of the same request (n > 1), whose prompt rows
        this one copies instead of prefilling them (prompt_sharing.py)."""
        params = constrained.sequential_params(self.resolve_mode(params))
        params = self.resolve_drafts(params)
        self.validate_prompt(prompt, params)
        params = replace(params, extra_stop_ids=self.model_stop_ids)
        seq = Sequence(next(self._ids), list(prompt), params, text_tail=self.text_tail)
        if params.grammar is not None:
            if self.grammars is None:
                raise InvalidRequest("structured output needs the tokenizer (use_grammars)")
            seq.matcher = self.grammars.matcher(params.grammar)
        # a recurrent state forks only at its own length, not at a choice's prompt - 1
        shares = self.scheduler.shares_prompts and not getattr(self.parts, "recurrent", False)
        if shares_with is not None and shares:
            seq.share_from = shares_with if can_share(seq, shares_with) else None
        seq.warning = self.mode_warning(params)
        if seq.warning and params.mode not in self._warned:
            self._warned.add(params.mode)  # once per mode: a busy server would repeat it
            log.warning("%s", seq.warning)
        self.scheduler.add(seq)
        return seq

    def resolve_drafts(self, params: GenerationParams) -> GenerationParams:
        """Speculative mode's draft source: "auto" becomes the draft model when one is
        loaded, else mask slots on a WeDLM-trained checkpoint, else prompt lookup."""
        if params.mode != Mode.SPECULATIVE or params.draft != "auto":
            return params
        if self.drafter is not None:
            return replace(params, draft="model")
        return replace(params, draft="mask" if self.config.wedlm_trained else "lookup")

    def validate_prompt(self, prompt: list[int], params: GenerationParams) -> None:
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if params.mode == Mode.DIFFUSION:
            raise InvalidRequest(
                f"mode diffusion needs a block-diffusion model (DiffusionGemma); this model "
                f"({self.config.model_type}) decodes with wedlm, ar or speculative"
            )
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        refused = refused_mode(
            params.mode,
            self.config.family,
            getattr(self.parts, "recurrent", False),
            getattr(self.parts, "sliding", False),
        )
        if refused:
            raise InvalidRequest(refused)
        masks = params.mode == Mode.WEDLM or params.draft == "mask"
        if masks and not 0 <= self.config.mask_token_id < vocab:
            what = "WeDLM mode" if params.mode == Mode.WEDLM else "mask-slot drafts"
            raise InvalidRequest(
                f"{what} need a mask token, but mask_token_id "
                f"{self.config.mask_token_id} is outside this model's vocabulary of {vocab} "
                f"(set mask_token_id in config.json, or use --mode ar)"
            )
        if params.draft == "model" and self.drafter is None:
            raise InvalidRequest(
                "draft 'model' needs a draft model: start the coordinator with --draft-model"
            )
        room = params.forward_rows
        limit = self.config.max_position_embeddings
        if len(prompt) + room > limit:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens; with a window of {room} rows it "
                f"exceeds the model's context of {limit} positions"
            )

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
        self._check_taken(flight.plans, before)
        self._cut = constrained.advance(flight.plans, before, frozenset(self._taken))
        self._taken = {}
        if ran.logprobs is not None:
            token_logprobs.record(
                ran.logprobs, flight.plans, before, ran.tokens, ran.fills, window_steps
            )
        if ran.prompt_scores is not None:
            token_logprobs.record_prompt(ran.prompt_scores, flight.plans)
        if ran.ahead and self.in_flight and self.in_flight[-1].unresolved:
            ahead = self.in_flight[-1]
            if self._cut & {p.seq.seq_id for p in ahead.plans}:
                self._drop_ahead(ahead)
            else:
                self._resolve_ahead(ahead, commits)
        self._start_fill()  # the next forward's matchers have taken this one's tokens
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

    def use_grammars(self, grammars: constrained.Grammars) -> None:
        """Decode requests with a grammar (structured output) through these matchers."""
        self.grammars = grammars

    def use_drafter(self, drafter) -> None:
        """Propose speculative drafts with this DraftModel (draft source "model")."""
        self.drafter = drafter

    def _launch(self, unit: Unit, plans: list[RowPlan]) -> None:
        started = time.perf_counter()
        plans = self._with_model_drafts(plans)
        batch = build_batch(plans, padding_ids=self._padding_ids(unit, len(plans)))
        hidden = self.parts.embed(mx.array(batch.tokens))
        batch_id = next(self._batch_ids)
        self._record_shape(batch_id, batch.spec)
        self.pipeline.submit(batch_id, batch.spec, hidden, batch.reply_slots())
        for plan in plans:  # the stages copy cached rows as this forward reaches them
            if plan.seq.prefix is not None:
                plan.seq.prefix.sent = True
        self.in_flight.append(InFlight(batch_id, unit, plans, batch, started))
        self._start_fill()

    def _start_fill(self) -> None:
        """Start filling the grammar masks of the oldest forward in flight on the grammars'
        thread, where its plans are known and its matchers have taken every committed
        token: the fill (llguidance, without the GIL) then overlaps this thread's work
        until _choose applies it. Nothing else touches those matchers meanwhile: advance
        runs after that forward's _complete has taken the fill."""
        if self.grammars is None or not self.fill_ahead or self._fill is not None:
            return
        if not self.in_flight or self.in_flight[0].batch is None:
            return  # an unresolved look-ahead: started once _resolve_ahead names its plans
        flight = self.in_flight[0]
        k = flight.batch.head_slots.shape[1]
        job = constrained.mask_job(flight.plans, k, self.config.vocab_size) if k else None
        if job is not None:
            future = self.grammars.filler.submit(
                constrained.fill_masks, job, self.grammars.executor
            )
            self._fill = (flight.batch_id, future)

    def _take_fill(self, batch_id: int) -> Future[constrained.Masks] | None:
        """The fill started for forward `batch_id`, if any. One started for a forward that
        was dropped since (a restart) is waited for: its matchers are then left alone."""
        pending, self._fill = self._fill, None
        if pending is None or pending[0] == batch_id:
            return pending and pending[1]
        with contextlib.suppress(Exception):
            pending[1].result()
        return None

    def _with_model_drafts(self, plans: list[RowPlan]) -> list[RowPlan]:
        """Rows drafting with the draft model get its proposals, then are planned again
        (their plans were made without drafts)."""
        rows = [  # a row its batch held back (draft_policy.batch_rooms) drafts nothing
            i for i, p in enumerate(plans)
            if p.seq.params.draft == "model" and p.seq.phase is Phase.DECODE and not p.held
        ]  # fmt: skip
        if not rows or self.drafter is None:
            return plans
        seqs = [plans[i].seq for i in rows]
        be = self.step_cost.break_even(len(plans))
        counts = [min(draft_room(s, be), s.params.max_tokens - len(s.output) - 1) for s in seqs]
        self.drafter.propose(seqs, counts)
        limit = self.config.max_position_embeddings
        plans = list(plans)
        for i, seq in zip(rows, seqs, strict=True):
            plans[i] = plan_speculative(seq, self.config.mask_token_id, limit, "model", be)
        return plans

    def drop_padding(self) -> None:
        """Release every padding row (while idle): the next batches make their own."""
        stale = sorted(i for ids in self._padding.values() for i in ids)
        if stale:
            self.pipeline.release(stale)
        self._padding.clear()

    def _padding_ids(self, unit: Unit, rows: int) -> list[int]:
        """Row counts are padded to buckets (bounded shapes); padding rows get ids of their
        own per unit, and the ones a unit stops using are released."""
        pad = row_bucket(rows) - rows
        base = (1 << 62) + (0 if unit is PREFILL else unit + 1) * 4096
        ids = {base + i for i in range(pad)}
        stale = self._padding.get(unit, set()) - ids
        if stale:  # a reused padding id starts at 0 and keeps nothing: order is irrelevant
            self.pipeline.release(sorted(stale), wait=False)
        self._padding[unit] = ids
        return sorted(ids)

    def _complete(self, commits: list[Commit]) -> Ran | None:
        """Run the oldest micro-batch to its tokens: collect its hidden states, head,
        selection and sampling, one host sync. The next forward goes to the device before
        the sync (the look-ahead, or another unit's micro-batch)."""
        self._start_fill()
        flight = self.in_flight.popleft()
        fill = self._take_fill(flight.batch_id)
        batch_id, hidden = self.pipeline.collect()
        assert batch_id == flight.batch_id, "micro-batches complete in order"
        if flight.dropped:  # its unit launches again from the cut windows
            self._compiling.discard(flight.batch_id)
            self.scheduler.ahead_dropped(flight.unit)
            self._schedule(commits)
            return self._complete(commits) if self.in_flight else None
        if flight.unresolved:  # a look-ahead WeDLM forward returned every slot
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
        ahead = (
            self._launch_ahead(flight, tokens)
            or self._launch_wedlm_ahead(flight, fills, tokens)
            or self._launch_speculative_ahead(flight, fills, tokens)
        )
        if not ahead:
            self._launch_other(commits)
        mx.eval(fills, tokens, *extra)  # the one host sync of this micro-batch
        host_tokens = np.array(tokens)
        if ahead and not self.in_flight[-1].unresolved:
            self._fill_early(flight, host_tokens)
        self.forwards += 1
        self._time_forward(flight)
        self._count_batch(flight)
        return Ran(flight, np.array(fills), host_tokens, ahead, logprobs, scores)

    def _fill_early(self, flight: InFlight, tokens: np.ndarray) -> None:
        """The masks of an autoregressive look-ahead forward, started before this step's
        postprocess: a constrained AR row commits its sampled token or finishes (and its
        next row is never read), so its matcher takes the token on the grammars' thread,
        which then fills the next forward's masks while postprocess runs here."""
        if self.grammars is None or not self.fill_ahead or self._fill is not None:
            return
        nxt = self.in_flight[0]
        if nxt is not self.in_flight[-1]:
            return  # another micro-batch completes before the look-ahead
        rows = [
            (i, p.seq) for i, p in enumerate(flight.plans)
            if p.seq.matcher is not None and not p.seq.finished and not p.seq.matcher.is_error()
        ]  # fmt: skip
        if not rows or any(seq.params.mode != Mode.AR for _, seq in rows):
            return
        job = constrained.mask_job(nxt.plans, nxt.batch.head_slots.shape[1], self.config.vocab_size)
        if job is None:
            return
        self._taken = {seq.seq_id: int(tokens[i, 0]) for i, seq in rows}
        taken = [(seq.matcher, self._taken[seq.seq_id]) for _, seq in rows]
        future = self.grammars.filler.submit(
            constrained.take_and_fill, taken, job, self.grammars.executor
        )
        self._fill = (nxt.batch_id, future)

    def _check_taken(self, plans: list[RowPlan], before: list[int]) -> None:
        """A row whose matcher took its token early (_fill_early) and then committed
        something else without finishing (not expected: an AR row commits its token or
        ends) gets its matcher corrected here, and the early fill is dropped."""
        wrong = [
            p.seq for p, start in zip(plans, before, strict=True)
            if p.seq.seq_id in self._taken and not p.seq.finished
            and p.seq.output[start:] != [self._taken[p.seq.seq_id]]
        ]  # fmt: skip
        if not wrong:
            return
        self._take_fill(-1)  # waited for, then dropped: the next forward fills inline
        for seq in wrong:
            seq.matcher.rollback(1)
            del self._taken[seq.seq_id]

    def _record_shape(self, batch_id: int, spec: RowsSpec) -> None:
        if self.shapes.record(spec):  # its first run compiles: no measure of a step's cost
            self._compiling.add(batch_id)

    def _time_forward(self, flight: InFlight) -> None:
        """Feed step_cost a decode forward's wall time (one micro-batch at a time: with
        several in flight the spans overlap): all one-row rows launched ahead (AR's
        cost), or rows with drafts or mask slots (a drafting forward's)."""
        done, last = time.perf_counter(), self._last_done
        self._last_done = done
        compiling = flight.batch_id in self._compiling
        self._compiling.discard(flight.batch_id)
        if self.micro_batches != 1 or flight.unit is PREFILL or compiling:
            return
        plans = flight.plans
        if any(p.seq.phase is not Phase.DECODE or p.seq.params.mode == Mode.WEDLM for p in plans):
            return
        if all(p.width == 1 for p in plans):
            if flight.started < last:  # launched ahead of the last one's read-back
                self.step_cost.observe(AR, len(plans), done - last)
        elif any(p.width > p.keep for p in plans):  # drafts or mask slots, as they run:
            # launched ahead (a probe, a chained spell) or after the last read-back. Either
            # way its cost is the time between read-backs, as AR's is: one launched after
            # the read-back also makes the device wait for the host's postprocess and
            # planning in between, which AR's look-ahead hides (its launch alone priced
            # 4-row drafts at 1.0 AR forwards on an H100, RESULTS.md SC9).
            self.step_cost.observe(DRAFT, len(plans), done - last)

    def _count_batch(self, flight: InFlight) -> None:
        spec = [p for p in flight.plans if speculative(p.seq)]
        if spec and flight.unit is not PREFILL and not flight.unresolved:
            self.speculative_batches += 1
            self.drafting_batches += any(p.width > p.keep for p in spec)

    def _launch_other(self, commits: list[Commit]) -> None:
        """Another unit's micro-batch (a prompt chunk, another group) does not depend on
        the one being completed: launch it now, so the device has work while the host reads
        and postprocesses that one (whose unit stays busy until postprocess)."""
        if len(self.in_flight) < self.micro_batches:
            picked = self.scheduler.next_micro_batch(commits)
            if picked is not None:
                self._launch(*picked)

    def _chain_breaks(self, unit: Unit, plans: list[RowPlan]) -> bool:
        """Whether a look-ahead built on the device must wait for the regular launch:
        arrivals or departures (it takes everyone), or a slot owed to a prefill or another
        group (no starving)."""
        if self.scheduler.joiners(unit, plans) != []:
            return True
        slot_owed = len(self.in_flight) + 1 >= self.micro_batches
        return slot_owed and self.scheduler.other_work(unit)

    def _past_context(self, plans: list[RowPlan], width: int) -> bool:
        """Whether a next forward `width` wide, after these rows' kept ones, passes the
        context of some row."""
        limit = self.config.max_position_embeddings
        return any(p.seq.kv_length + p.keep + width > limit for p in plans)

    def _launch_wedlm_ahead(self, flight: InFlight, fills: mx.array, tokens: mx.array) -> bool:
        """For a micro-batch of WeDLM decode rows, launch the next forward from this step's
        selection before reading it back (wedlm_ahead.py): the device computes step t+1
        while the host reads step t and postprocesses it. Only where every layer runs in
        this process (workers take a forward's kept rows with the forward)."""
        if not getattr(self.pipeline, "keeps_later", False) or flight.unit is PREFILL:
            return False
        live = [i for i, p in enumerate(flight.plans) if not p.seq.finished]
        plans = [flight.plans[i] for i in live]
        if not plans or not all(_wedlm_decoding(p) for p in plans):
            return False
        constrained_rows = {p.seq.seq_id for p in plans if p.seq.matcher is not None}
        if constrained_rows and (not self.constrained_ahead or constrained_rows & self._cut):
            return False  # the grammar cut a run at the last step: it may well cut again
        if self._chain_breaks(flight.unit, plans):
            return False
        if all(len(p.seq.output) + len(p.commits) >= p.seq.params.max_tokens for p in plans):
            return False  # every row ends at this step
        width = padded_width(2 * max(p.head_slots.size for p in plans))
        if self._past_context(plans, width):
            return False
        started = time.perf_counter()
        padding = self._padding_ids(flight.unit, len(plans))
        if live != list(range(len(live))):  # rows that finished drop out (else: a prefix,
            rows = mx.array(live)  # which next_inputs slices for free)
            fills, tokens = fills[rows], tokens[rows]
        ids, filled = next_inputs(
            plans, fills, tokens, self.config.mask_token_id, width, len(padding)
        )
        b = len(plans) + len(padding)
        spec = RowsSpec(
            seq_ids=[p.seq.seq_id for p in plans] + padding,
            starts=np.array([p.seq.kv_length + p.keep for p in plans] + [0] * len(padding)),
            widths=np.array([width] * len(plans) + [1] * len(padding)),
            filled=np.zeros((b, width), dtype=bool),  # on the device only: `visibility`
            keeps=np.zeros(b, dtype=np.int64),  # named by _resolve_ahead (pipeline.keep)
            visibility=compiled_device_visibility(filled),
        )
        batch_id = next(self._batch_ids)
        self._record_shape(batch_id, spec)
        self.pipeline.submit(batch_id, spec, self.parts.embed(ids))
        # plans of step t stand in until _resolve_ahead names this forward's own
        self.in_flight.append(InFlight(batch_id, flight.unit, plans, None, started, True))
        return True

    def _launch_speculative_ahead(
        self, flight: InFlight, fills: mx.array, tokens: mx.array
    ) -> bool:
        """For a micro-batch of speculative rows in a drafting spell, launch the next
        verifying forward from this step's choices before reading them back
        (speculative_ahead.py). Only where every layer runs in this process, as WeDLM's."""
        if not self.speculative_ahead or flight.unit is PREFILL:
            return False
        if not getattr(self.pipeline, "keeps_later", False):
            return False
        live = [i for i, p in enumerate(flight.plans) if not p.seq.finished]
        plans = [flight.plans[i] for i in live]
        if not plans or not all(speculative_ahead.chains(p) for p in plans):
            return False
        if self._chain_breaks(flight.unit, plans):
            return False
        if all(len(p.seq.output) + p.drafts + 1 >= p.seq.params.max_tokens for p in plans):
            return False  # every row may end at this step
        width = flight.batch.tokens.shape[1]
        if self._past_context(plans, width):
            return False
        started = time.perf_counter()
        padding = self._padding_ids(flight.unit, len(plans))
        rows = mx.array(live)
        caps = speculative_ahead.caps(plans)
        ids = speculative_ahead.next_inputs(
            plans, fills[rows], tokens[rows], self.config.mask_token_id, width, len(padding), caps
        )
        b = len(plans) + len(padding)
        spec = RowsSpec(
            seq_ids=[p.seq.seq_id for p in plans] + padding,
            starts=np.array([p.seq.kv_length + p.keep for p in plans] + [0] * len(padding)),
            widths=np.array([width] * len(plans) + [1] * len(padding)),
            filled=np.ones((b, width), dtype=bool),  # causal rows (speculative_ahead.py)
            keeps=np.zeros(b, dtype=np.int64),  # named by _resolve_ahead (pipeline.keep)
            # as an explicit mask: the fused causal path takes the exact KV span, a key
            # length new to MLX-CUDA's attention at every step (RESULTS.md SC8)
            visibility=mx.array(np.broadcast_to(np.tri(width, dtype=bool), (b, width, width))),
        )
        batch_id = next(self._batch_ids)
        self._record_shape(batch_id, spec)
        self.pipeline.submit(batch_id, spec, self.parts.embed(ids))
        # plans of step t stand in until _resolve_ahead names this forward's own
        self.in_flight.append(
            InFlight(batch_id, flight.unit, plans, None, started, True, width=width, caps=caps)
        )
        self.speculative_chained += 1
        return True

    def _drop_ahead(self, flight: InFlight) -> None:
        """The grammar cut a window's leading run (constrained.advance) that the look-ahead
        forward was built from uncut: its inputs are not the window's. Nothing of it becomes
        permanent; _complete reads it back, discards it, and launches the unit again."""
        self.pipeline.keep([p.seq.seq_id for p in flight.plans], [0] * len(flight.plans))
        flight.dropped = True
        self.ahead_dropped += 1

    def _resolve_ahead(self, flight: InFlight, commits: list[Commit]) -> None:
        """Step t is read back and postprocessed: the look-ahead forward's rows are now
        known. Its plans are the ones a regular launch would make now (a sequence whose
        committing tokens end it finishes without them), its kept rows are named to the
        pipeline, and selection will read the head slots of each plan."""
        plans, keeps = [], []
        for i, stand_in in enumerate(flight.plans):
            seq = stand_in.seq
            if seq.finished:
                plan = None
            elif seq.params.mode == Mode.SPECULATIVE:  # built on the device (speculative_ahead)
                cap = flight.caps[i]
                plan = speculative_ahead.resolve(
                    stand_in, flight.width, cap, self.config.mask_token_id
                )
            else:
                plan = self.scheduler.plan_or_finish(seq, commits)
            if plan is None:  # its row runs anyway; nothing of it is kept or read
                plan = RowPlan(seq, stand_in.tokens[:1], stand_in.filled[:1], 0, _NONE, _NO)
            plans.append(plan)
            keeps.append(plan.keep)
        self.pipeline.keep([p.seq.seq_id for p in plans], keeps)
        flight.plans = plans
        flight.batch = build_batch(plans)

    def _launch_ahead(self, flight: InFlight, tokens: mx.array) -> bool:
        """For a micro-batch of autoregressive decode rows, launch the next forward from the
        sampled tokens before reading them back, as mlx-lm does: the device computes step
        t+1 while the host checks stops of step t (ar_ahead.py: which rows qualify; mask
        probes of speculative rows ride it too). A row that stops at t wastes one row of
        t+1 (its KV past the end is stale and released). Sequences that joined the group
        since (their prefill just ended) join this forward: their next input is already on
        the host, so arrivals do not break the chain."""
        live = [i for i, p in enumerate(flight.plans) if not p.seq.finished]
        plans = [flight.plans[i] for i in live]
        if not plans or flight.unit is PREFILL:
            return False
        be = self.step_cost.break_even(len(plans))
        limit = self.config.max_position_embeddings
        own = next_plans(plans, be, self.config.mask_token_id, limit)
        if own is None:
            return False
        joiners = self.scheduler.joiners(flight.unit, plans)
        if joiners is None:
            return False  # a row left the group: the next regular launch takes everyone
        if not all(ar_decoding(s) for s in joiners):
            return False
        slot_owed = len(self.in_flight) + 1 >= self.micro_batches
        if slot_owed and self.scheduler.other_work(flight.unit):
            return False  # the slot is owed to a prefill or another group: no starving
        if not joiners and all(len(p.seq.output) + 1 >= p.seq.params.max_tokens for p in plans):
            return False  # every row ends at this step
        if any(p.seq.kv_length + 1 + n.width > limit for p, n in zip(plans, own, strict=True)):
            return False
        if any(s.kv_length + 1 > limit for s in joiners):
            return False
        started = time.perf_counter()
        nxt = own + [plan_autoregressive(s) for s in joiners]
        batch = build_batch(nxt, padding_ids=self._padding_ids(flight.unit, len(nxt)))
        batch.spec.starts[: len(plans)] += 1  # after step t's row becomes permanent
        ids = tokens[mx.array(live), :1]
        if joiners:  # their first token came back with their prefill
            last = mx.array([[s.output[-1]] for s in joiners], dtype=ids.dtype)
            ids = mx.concatenate([ids, last])
        pad = batch.tokens.shape[0] - ids.shape[0]
        if pad:
            ids = mx.concatenate([ids, mx.zeros((pad, 1), ids.dtype)])
        if batch.tokens.shape[1] > 1:  # a probe's mask slots (and padding past rows' ends)
            ids = mx.concatenate([ids.astype(mx.int32), mx.array(batch.tokens[:, 1:])], axis=1)
        batch_id = next(self._batch_ids)
        self._record_shape(batch_id, batch.spec)
        self.pipeline.submit(batch_id, batch.spec, self.parts.embed(ids), batch.reply_slots())
        self.in_flight.append(InFlight(batch_id, flight.unit, nxt, batch, started))
        return True

    def _select(
        self, batch: TickBatch, hidden: mx.array, fill: Future[constrained.Masks] | None = None
    ) -> tuple[mx.array, mx.array, token_logprobs.SlotLogprobs | None]:
        """Head on the needed rows, selection and sampling on the device, left lazy, and
        the logprobs of rows that ask. Only what the batch needs is built: every op here
        sits between two forwards on the device, so a greedy autoregressive batch pays for
        the head and an argmax only. `fill`: the batch's grammar masks, being filled
        (_start_fill); without it they are filled here."""
        rows = len(batch.plans)
        if not batch.wants_head:
            return mx.zeros((rows, 0), mx.bool_), mx.zeros((rows, 0), mx.int32), None
        logits = self.parts.head(hidden[:rows])  # the pipeline returned the head slots only
        fills, tokens = self._choose(batch, logits, fill)
        return fills, tokens, token_logprobs.slot_logprobs(batch.plans, logits, tokens)

    def _choose(
        self, batch: TickBatch, logits: mx.array, fill: Future[constrained.Masks] | None = None
    ) -> tuple[mx.array, mx.array]:
        """Selection (which slots fill) and sampling (with which tokens)."""
        if batch.any_selection or batch.any_sampling:
            logits = logits.astype(mx.float32)  # entropy and sampling work in float32
        is_mask = mx.array(batch.head_is_mask)
        if batch.any_selection:
            chosen = batch.selection_arrays()
            # compiled for WeDLM batches, whose head slots are W per row every step; a
            # speculative batch's vary with its drafts, and each new shape costs a trace
            select = eager_window_fills if batch.any_speculative else window_fills
            fills = select(
                logits,
                is_mask,
                chosen["threshold"],
                chosen["penalty"],
                batch.selection_offsets(),
            )
        else:  # AR rows fill their one slot (an infinite threshold): exactly is_mask
            fills = is_mask
        # after selection, which reads the raw logits' entropies
        logits = logit_bias.adjust_logits(batch.plans, logits)
        if fill is not None:  # the last thing before sampling: the fill had the longest
            logits = constrained.apply_masks(fill.result(), logits)
        elif self.grammars is not None:
            logits = constrained.mask_logits(batch.plans, logits, self.grammars.executor)
        if not batch.any_sampling:
            return fills, greedy_tokens(logits)
        arrays = batch.sampling_arrays()
        tokens = sample_tokens(
            logits,
            arrays["temperature"],
            arrays["top_k"],
            arrays["top_p"],
            arrays["seed"],
            arrays["counter"],
            any_sampling=True,
            any_filter=batch.any_filter,
            strides=arrays["stride"] if batch.any_speculative else None,
            greedy_slots=batch.greedy_slots(),
        )
        return fills, tokens

    def restart_on(self, pipeline: Pipeline, micro_batches: int | None = None) -> None:
        """Continue on a new pipeline after losing a worker: forwards in flight are gone,
        so every live sequence re-prefills its committed history, then decodes on."""
        stale = self.scheduler.row_ids()
        stale += [i for ids in self._padding.values() for i in ids]
        stale += self._drop_cache()  # rebuilt by use, never trusted stale
        pipeline.release(stale)  # surviving workers may still hold rows of these
        self.in_flight.clear()
        self._compiling.clear()
        self._padding.clear()
        self.pipeline = pipeline
        if micro_batches:
            self.micro_batches = micro_batches
        self.scheduler.restart(self.micro_batches)

    def requeue_for_memory(self) -> list[Sequence]:
        """After a forward ran out of memory: the forwards in flight are dropped (what the
        stages still answer is read and discarded, so the pipeline is empty, not re-planned),
        every stage forgets the running sequences' rows and the prefix cache, MLX's free
        buffers go back to the system, and the running sequences wait in the queue again
        to rebuild their KV from their tokens. Returns the sequences requeued."""
        for _ in range(len(self.in_flight)):
            with contextlib.suppress(Exception):  # a forward that failed too: nothing kept
                self.pipeline.collect()
        self.in_flight.clear()
        stale = self.scheduler.row_ids()
        stale += [i for ids in self._padding.values() for i in ids]
        stale += self._drop_cache()
        self._padding.clear()
        self.pipeline.release(stale)
        mx.synchronize()  # nothing may be recording when the buffers are freed (CUDA)
        mx.clear_cache()
        return self.scheduler.requeue_running()

    def shape_limits(self) -> ShapeLimits:
        """What bounds this engine's forward shapes (`shape_limits().bound()` counts them)."""
        return self.scheduler.shape_limits()

    def take_undelivered(self) -> list[Commit]:
        commits, self.undelivered = self.undelivered, []
        return commits

    def fail_all(self) -> list[Sequence]:
        """Finish every running sequence with an error (a forward was lost)."""
        self.in_flight.clear()
        self._padding.clear()
        self._drop_cache()
        return self.scheduler.fail_all()

    # ---- convenience ------------------------------------------------------------------
    def stream(self, seqs: list[Sequence]) -> Iterator[Commit]:
        """Tick until these sequences finish, yielding their commits as they happen."""
        wanted = {s.seq_id for s in seqs}
        while any(not s.finished for s in seqs):
            for c in self.step():
                if c.seq.seq_id in wanted:
                    yield c


_NONE = np.zeros(0, dtype=np.int64)
_NO = np.zeros(0, dtype=bool)


def _wedlm_decoding(plan: RowPlan) -> bool:
    """A WeDLM window row (its sequence past its prompt)."""
    seq = plan.seq
    return seq.phase is Phase.DECODE and seq.params.mode == Mode.WEDLM and plan.head_slots.size > 0
