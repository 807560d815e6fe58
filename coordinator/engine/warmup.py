"""Warm start: before the first user arrives, run each forward shape that serving uses first
once, through the engine's current pipeline and the head, selection and sampling path, so
that MLX compiles its kernels now rather than during the first burst of requests.

The set: row buckets up to max_rows' bucket x widths (1 for AR rows; the padded WeDLM widths
W..2W of each window; the padded prompt chunk widths, with as many rows as a prefill
micro-batch can hold) x the first `spans` attention spans (prompts at the first only). Rows
use throw-away sequence ids, keep no KV past the forwards that set up their lengths, and are
released at the end: the engine keeps nothing of it but the shapes it ran.

With `timing`, it then measures the break-even of speculative drafts (step_timing.py)
through the same pipeline. A server does not: it leaves that to the engine's idle time
(coordinator/service/startup_costs.py), and says how far the warm-up is every few seconds."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from common.generation_params import GenerationParams
from common.modes import Mode
from coordinator.engine.engine import Engine
from coordinator.engine.forward_shapes import (
    WIDE_FROM,
    ShapeKey,
    padded_width,
    row_bucket,
    shape_key,
)
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Sequence
from coordinator.engine.step_timing import measure_step_cost
from coordinator.engine.tick_batch import TickBatch, build_batch

log = logging.getLogger(__name__)

WARM_IDS = 1 << 61  # throw-away sequence ids (real ids count up from 0, padding from 1 << 62)
WARM_BATCH_IDS = 1 << 41  # batch ids of warm-up forwards (the engine's count up from 1)
SETUP_WIDTH = 8  # a first forward gives the rows of a bucket KV lengths 0..7, as in serving
EXTEND_WIDTH = 64  # then each further span adds this many rows of KV
PROGRESS_EVERY_S = 5.0  # a long warm-up says how far it is at least this often

_AR = GenerationParams(mode=Mode.AR, max_tokens=1)
_SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}  # the filtering sampling path


@dataclass
class WarmUpReport:
    forwards: int  # forwards run, including the ones that set up KV lengths
    shapes: int  # distinct shape keys among them
    new_shapes: int  # of which the engine had not run before
    seconds: float
    keys: frozenset[ShapeKey] = frozenset()


def row_buckets(most: int) -> list[int]:
    """The row buckets of batches of 1..most rows."""
    return sorted({row_bucket(n) for n in range(1, most + 1)})


def warm_up(
    engine: Engine,
    max_rows: int | None = None,
    spans: int = 2,
    windows: Iterable[int] = (16,),
    prefill: bool = True,
    bursts: bool = True,
    timing: bool = True,
) -> WarmUpReport:
    """Run the first shapes of the bounded set once. Call on the thread that owns MLX, while
    no forward is in flight (before serving, or right after a re-plan).

    max_rows: the largest row count (default: max_running); spans: attention spans warmed
    for decode rows (64, 128, ...); windows: WeDLM windows whose widths W..2W are warmed;
    prefill: also warm the padded prompt chunk widths at the first span; bursts: then, if
    the engine is idle (not after a re-plan, when live sequences re-prefill), run short real
    requests through it, AR and WeDLM mixed, at each row bucket: what a first burst runs
    besides the forwards (KV regathered as rows join and leave, the mixed head path);
    timing: then measure what a drafting forward costs against an AR one (step_timing.py),
    the break-even of speculative drafts, logged and kept in engine.step_cost."""
    assert not engine.in_flight, "warm up while no forward is in flight"
    started = time.perf_counter()
    warmer = _Warmer(engine)
    buckets = row_buckets(max_rows or engine.shape_limits().max_rows)
    said = started
    try:
        for i, r in enumerate(buckets):
            for _ in warmer.bucket(r, spans, tuple(windows), prefill):
                pass
            if (now := time.perf_counter()) - said >= PROGRESS_EVERY_S:
                said = now
                log.info(
                    "warming up: %d of %d row counts, %d shapes in %.0f s",
                    i + 1, len(buckets), len(warmer.keys), now - started,
                )  # fmt: skip
    finally:
        if warmer.used:
            engine.pipeline.release(warmer.used)
    if bursts and not engine.scheduler.has_work():
        cache, engine.scheduler.cache = engine.scheduler.cache, None  # keeps no warm-up text
        try:
            _bursts(engine, buckets, next(iter(windows), 16), warmer.wedlm)
        finally:
            engine.scheduler.cache = cache
    if timing:
        measure_step_cost(engine, buckets)  # the break-even of speculative drafts
    report = WarmUpReport(
        forwards=warmer.forwards,
        shapes=len(warmer.keys),
        new_shapes=warmer.new,
        seconds=time.perf_counter() - started,
        keys=frozenset(warmer.keys),
    )
    log.info(
        "warm-up: %d forwards, %d shapes (%d new) in %.2f s",
        report.forwards,
        report.shapes,
        report.new_shapes,
        report.seconds,
    )
    return report


class WarmUpRun:
    """The rest of the bounded shape set, one forward per `step`, for a server to run on
    the engine thread while it is idle (startup_costs.py): the row buckets above the first
    ones, which only a burst of users reaches. A request that comes meanwhile waits for
    one forward at most; its rows are a KV batch of their own in the stages (kv_store.py),
    so the warm-up's rows, kept between steps, neither see nor disturb them."""

    def __init__(
        self,
        engine: Engine,
        buckets: list[int],
        spans: int = 2,
        windows: Iterable[int] = (16,),
        prefill: bool = True,
    ) -> None:
        self.engine = engine
        self.warmer = _Warmer(engine)
        self.buckets = list(buckets)
        self._args = (spans, tuple(windows), prefill)
        self._current: Iterator[None] | None = None
        self.seconds = 0.0  # spent in steps

    @property
    def done(self) -> bool:
        return not self.buckets and self._current is None

    def step(self) -> bool:
        """One forward; False once the set is done (everything released). Call while the
        engine has no forward in flight (its idle time)."""
        assert not self.engine.in_flight, "the background warm-up runs while idle"
        started = time.perf_counter()
        try:
            while not self.done:
                if self._current is None:
                    self._current = self.warmer.bucket(self.buckets[0], *self._args)
                try:
                    next(self._current)
                    return True
                except StopIteration:  # this bucket's shapes are done: its rows go
                    self.buckets.pop(0)
                    self._current = None
                    self._release()
            return False
        finally:
            self.seconds += time.perf_counter() - started

    def close(self) -> None:
        """Stop (the server stopping): the rows it holds are released."""
        self.buckets, self._current = [], None
        self._release()

    def drop(self) -> None:
        """Stop after a re-plan: its rows were in the old pipeline's stages."""
        self.buckets, self._current, self.warmer.used = [], None, []

    def _release(self) -> None:
        if self.warmer.used:
            used, self.warmer.used = self.warmer.used, []
            self.engine.pipeline.release(used)


def _bursts(engine: Engine, buckets: list[int], window: int, wedlm: bool) -> None:
    vocab = engine.config.vocab_size
    ids = itertools.count(WARM_IDS + (1 << 40))  # apart from the shape sweep's ids
    forwards = engine.forwards
    for rows in buckets:
        seqs = []
        for i in range(rows):
            mode = Mode.WEDLM if wedlm and i % 2 else Mode.AR
            params = GenerationParams(mode=mode, window=window, max_tokens=3 + i % 4)
            prompt = [(7 * i + j + 1) % vocab for j in range(3 + i % 5)]
            seqs.append(Sequence(next(ids), prompt, params))
            engine.scheduler.add(seqs[-1])
        for _ in engine.stream(seqs):
            pass
        while engine.in_flight:  # a look-ahead launched before the last rows finished
            engine.step()
    engine.forwards = forwards  # the counters speak of real requests only
    engine.drop_padding()


class _Warmer:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ids = itertools.count(WARM_IDS)
        self.batch_ids = itertools.count(WARM_BATCH_IDS)
        self.used: list[int] = []
        self.keys: set[ShapeKey] = set()
        self.forwards = 0
        self.new = 0
        self.max_positions = engine.config.max_position_embeddings
        vocab = engine.config.vocab_size
        self.wedlm = 0 <= engine.config.mask_token_id < vocab  # else no WeDLM request runs

    def bucket(
        self, rows: int, spans: int, windows: tuple[int, ...], prefill: bool
    ) -> Iterator[None]:
        """The forwards of one row bucket, one per `next` (a background warm-up runs one
        at a time while the engine is idle)."""
        ids = [next(self.ids) for _ in range(rows)]
        self.used += ids
        lengths = np.zeros(rows, dtype=np.int64)
        if prefill:
            yield from self.prompts(ids, lengths)
        if rows > 1:  # running sequences have KV lengths of their own (the scattered writes)
            keeps = np.arange(rows) % SETUP_WIDTH
            yield self.run(ids, lengths, [_row(_AR, SETUP_WIDTH, keep=int(k)) for k in keeps])
        for span in range(spans):
            if span:
                if lengths.max() + EXTEND_WIDTH > self.max_positions:
                    return
                full = _row(_AR, EXTEND_WIDTH, keep=EXTEND_WIDTH)
                yield self.run(ids, lengths, [full] * rows)
            first = span == 0  # the sampling paths once per row bucket and head width
            if lengths.max() + 1 <= self.max_positions:
                yield self.run(ids, lengths, [_row(_AR, 1, head=True)] * rows, sample=first)
            for w in windows if self.wedlm else ():
                params = GenerationParams(mode=Mode.WEDLM, window=w, max_tokens=1)
                widths = sorted({padded_width(w + p) for p in range(w + 1)})
                for i, t in enumerate(widths):
                    p = min(w, t - w)  # committed slots: W + p rows pad to t
                    if lengths.max() + w + p > self.max_positions:
                        break
                    plan = _wedlm_row(params, w, p)
                    yield self.run(ids, lengths, [plan] * rows, sample=first and i == 0)

    def prompts(self, ids: list[int], lengths: np.ndarray) -> Iterator[None]:
        """Prompt chunks at start 0 (kept nowhere), for every padded width a prefill
        micro-batch of this many rows can have: one row, or padded rows x padded width
        within the prefill budget (the scheduler's rule)."""
        limits = self.engine.limits
        rows, prev = len(ids), 1
        for t in sorted({padded_width(t) for t in range(2, limits.prefill_chunk + 1)}):
            shortest, prev = prev + 1, t  # the shortest chunk that pads to t
            if (rows > 1 and rows * t > limits.prefill_budget) or t > self.max_positions:
                continue
            # A lone chunk that pads to t takes the explicit-mask path; one of exactly t the
            # causal fast path (run at the narrow widths only: the wide ones cost the most
            # and share its kernels). A batch of several has chunks of several lengths.
            variants = [[shortest]] + [[t]] * (t <= WIDE_FROM)
            if rows > 1:
                variants = [[t] + [shortest] * (rows - 1)]
            for widths in variants:
                yield self.run(ids, lengths, [_row(_AR, w, head=True) for w in widths])

    def run(
        self, ids: list[int], lengths: np.ndarray, rows: list[dict], sample: bool = False
    ) -> None:
        engine = self.engine
        plans = [
            RowPlan(seq=Sequence(sid, [0], row["params"], kv_length=int(n)), **row["plan"])
            for sid, n, row in zip(ids, lengths, rows, strict=True)
        ]
        batch = build_batch(plans)
        self.keys.add(shape_key(batch.spec))
        self.new += engine.shapes.record(batch.spec)
        batch_id = next(self.batch_ids)
        hidden = engine.parts.embed(mx.array(batch.tokens))
        engine.pipeline.submit(batch_id, batch.spec, hidden, batch.reply_slots())
        got, hidden = engine.pipeline.collect()
        assert got == batch_id, "warm-up runs one forward at a time"
        outs = list(engine._select(batch, hidden)[:2])
        if sample and batch.wants_head:
            outs += engine._select(_sampled(batch), hidden)[:2]
        mx.eval(hidden, *outs)
        lengths += batch.spec.keeps
        self.forwards += 1


def _row(params: GenerationParams, width: int, keep: int = 0, head: bool = False) -> dict:
    """A fully filled row (a prompt chunk, or an AR step when width is 1)."""
    slots = np.array([width - 1] if head else [], dtype=np.int64)
    plan = {
        "tokens": np.zeros(width, np.int32),
        "filled": np.ones(width, dtype=bool),
        "keep": keep,
        "head_slots": slots,
        "head_is_mask": np.ones(slots.size, dtype=bool),
    }
    return {"params": params, "plan": plan}


def _wedlm_row(params: GenerationParams, window: int, p: int) -> dict:
    """A WeDLM window after p slots committed: p filled rows, then W slots, some filled."""
    filled = np.concatenate([np.ones(p, bool), np.arange(window) % 3 == 1])
    plan = {
        "tokens": np.zeros(window + p, np.int32),
        "filled": filled,
        "keep": 0,
        "head_slots": np.arange(p, p + window),
        "head_is_mask": ~filled[p:],
    }
    return {"params": params, "plan": plan}


def _sampled(batch: TickBatch) -> TickBatch:
    """The same batch with sampling (top-k and top-p) parameters on every row."""
    plans = [
        replace(p, seq=replace(p.seq, params=replace(p.seq.params, **_SAMPLED)))
        for p in batch.plans
    ]
    return replace(batch, plans=plans)
