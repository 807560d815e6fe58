"""Measure the break-even of speculative drafts (step_cost.py) on this machine and model:
per row bucket, the wall time of a drafting forward (1 + k drafts + m mask slots rows per
sequence, read back before the next one is launched, as the engine must) against an AR
forward (one row per sequence, the next one launched before this one is read back: AR's
look-ahead). Each through the engine's pipeline, head, selection and sampling path, after
one untimed forward of each shape (its compile). Throw-away rows at KV length 0 that keep
nothing; released at the end."""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Iterable

import mlx.core as mx
import numpy as np

from common.generation_params import GenerationParams
from coordinator.engine.engine import Engine
from coordinator.engine.forward_shapes import row_bucket
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Sequence
from coordinator.engine.tick_batch import TickBatch, build_batch

log = logging.getLogger(__name__)

TIMING_IDS = (1 << 61) + (1 << 45)  # throw-away sequence ids (apart from warm-up's)
_batch_ids = itertools.count((1 << 41) + (1 << 36))  # apart from the engine's and warm-up's
DRAFTS = 4  # a representative drafting forward: 4 drafts and 5 mask slots


def measure_step_cost(
    engine: Engine,
    rows: Iterable[int] | None = None,
    window: int = 8,
    repeats: int = 4,
    rounds: int = 3,
    budget_s: float | None = None,
) -> dict[int, float]:
    """Drafting forward / AR forward, per row bucket (default: every bucket up to the
    engine's max rows), medians of `rounds` interleaved rounds of `repeats` forwards each;
    seeds the engine's StepCost and returns the ratios. Call on the thread that owns MLX
    while no forward is in flight.

    budget_s: measure the buckets smallest first and stop where the next one (at least as
    slow as the last) would end past this many seconds; the larger buckets then take the
    largest measured one's ratio (StepCost.break_even). A slow backend (MLX's CPU, through
    stages) would otherwise hold a server's readiness for minutes."""
    assert not engine.in_flight, "measure while no forward is in flight"
    started = time.perf_counter()
    most = engine.shape_limits().max_rows
    buckets = sorted({row_bucket(r) for r in (rows or range(1, most + 1))})
    config = engine.config
    masks = 0 <= config.mask_token_id < config.vocab_size
    k = min(DRAFTS, window)
    ratios, used = {}, []
    try:
        for r in buckets:
            bucket_started = time.perf_counter()
            ids = [TIMING_IDS + len(used) + i for i in range(r)]
            used += ids
            ar = _batch(ids, 0, 0)
            draft = _batch(ids, k, k + 1 if masks else 0)
            times: dict[str, list[float]] = {"ar": [], "draft": []}
            _per_forward(engine, ar, 1, ahead=True)  # compile both shapes first
            _per_forward(engine, draft, 1, ahead=False)
            for _ in range(rounds):
                times["ar"].append(_per_forward(engine, ar, repeats, ahead=True))
                times["draft"].append(_per_forward(engine, draft, repeats, ahead=False))
            ratios[r] = statistics.median(times["draft"]) / statistics.median(times["ar"])
            now = time.perf_counter()
            spent = now - started
            if (
                budget_s is not None
                and spent + (now - bucket_started) > budget_s
                and r < buckets[-1]
            ):
                log.info(
                    "draft break-even measured up to %d rows in %.1f s (budget %g s): "
                    "larger row buckets take its ratio",
                    r, spent, budget_s,
                )  # fmt: skip
                break
    finally:
        if used:
            engine.pipeline.release(used)
    engine.step_cost.seed(ratios)
    log.info(
        "draft break-even (a drafting forward in AR forwards, by rows): %s, measured in %.2f s",
        ", ".join(f"{r}: {v:.2f}" for r, v in ratios.items()),
        time.perf_counter() - started,
    )
    return ratios


def _batch(ids: list[int], drafts: int, masks: int) -> TickBatch:
    """One row per id: the last committed token, `drafts` drafts and `masks` mask slots,
    with the logits of every row (as a speculative forward reads them)."""
    width = 1 + drafts + masks
    mode = "speculative" if width > 1 else "ar"
    params = GenerationParams(mode=mode, window=max(drafts, 1), max_tokens=width + 1)
    plans = [
        RowPlan(
            seq=Sequence(sid, [0], params),
            tokens=np.zeros(width, np.int32),
            filled=np.arange(width) <= drafts,
            keep=0,
            head_slots=np.arange(width),
            head_is_mask=np.arange(width) > drafts,
            drafts=drafts,
        )
        for sid in ids
    ]
    return build_batch(plans)


def _per_forward(engine: Engine, batch: TickBatch, n: int, ahead: bool) -> float:
    """Seconds per forward over `n` forwards of `batch`, launched as the engine launches
    them: the next one before this one's read-back (`ahead`), or after it."""

    def launch() -> None:
        hidden = engine.parts.embed(mx.array(batch.tokens))
        engine.pipeline.submit(next(_batch_ids), batch.spec, hidden, batch.reply_slots())

    start = time.perf_counter()
    launch()
    for i in range(n):
        _, hidden = engine.pipeline.collect()
        out = engine._select(batch, hidden)[:2]
        mx.async_eval(*out)
        if ahead and i + 1 < n:
            launch()
        mx.eval(*out)
        if not ahead and i + 1 < n:
            launch()
    return (time.perf_counter() - start) / n
