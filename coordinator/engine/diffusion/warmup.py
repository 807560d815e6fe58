"""Warm start for a diffusion model: before the first user, short real requests at each
row bucket (both samplers; two canvases each, so prompt+canvas rows, canvas rows, repair
rows and commit+canvas rows all run), so that MLX compiles those kernels now."""

from __future__ import annotations

import itertools
import time

from common.generation_params import GenerationParams
from common.modes import Mode
from coordinator.engine.diffusion.engine import DiffusionEngine
from coordinator.engine.forward_shapes import row_bucket
from coordinator.engine.sequence import Sequence
from coordinator.engine.warmup import WARM_IDS, WarmUpReport

WARM_STEPS = 3  # denoising steps per warm-up canvas: the shapes, not the text, matter


def warm_up_diffusion(engine: DiffusionEngine, max_rows: int | None = None) -> WarmUpReport:
    assert not engine.in_flight, "warm up while no forward is in flight"
    started = time.perf_counter()
    before = set(engine.shapes.seen)
    forwards = engine.forwards
    most = max_rows or engine.shape_limits().max_rows
    vocab = engine.config.vocab_size
    canvas = engine.settings.canvas_length
    ids = itertools.count(WARM_IDS + (1 << 40))
    for rows in sorted({row_bucket(n) for n in range(1, most + 1)}):
        seqs = []
        for i in range(rows):
            params = GenerationParams(
                mode=Mode.DIFFUSION,
                sampler=("turbo", "faithful")[i % 2],
                steps=WARM_STEPS,
                max_tokens=canvas + 1,
            )
            prompt = [(7 * i + j + 1) % vocab for j in range(3 + i % 5)]
            seqs.append(Sequence(next(ids), prompt, params))
            engine.scheduler.add(seqs[-1])
        for _ in engine.stream(seqs):
            pass
    ran = engine.forwards - forwards
    engine.forwards = forwards  # the counters speak of real requests only
    engine.drop_padding()
    keys = frozenset(engine.shapes.seen)
    return WarmUpReport(
        forwards=ran,
        shapes=len(keys),
        new_shapes=len(keys - before),
        seconds=time.perf_counter() - started,
        keys=keys,
    )
