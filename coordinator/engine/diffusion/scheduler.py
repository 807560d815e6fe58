"""The scheduler of diffusion requests: the WeDLM/AR scheduler's admission, groups, prefill
turns and reaping (scheduler.py), with each request's next forward planned and its result
applied by the canvas state machine (diffusion/canvas.py). A step's results arrive as
per-row host arrays (`CanvasResults`); the commit decisions are made here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx
import numpy as np

from coordinator.engine.diffusion.canvas import (
    Canvas,
    new_canvas,
    pending,
    plan_canvas,
    plan_compacted,
)
from coordinator.engine.diffusion.settings import DiffusionSettings
from coordinator.engine.forward_shapes import ShapeLimits
from coordinator.engine.modes import plan_prefill
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.scheduler import Scheduler
from coordinator.engine.sequence import Phase, Sequence

CanvasResults = dict[int, dict[str, np.ndarray]]  # batch row -> host arrays of its step


def repeat_end(output: list[int], start: int, run: int) -> int | None:
    """Where the first run of `run` equal tokens that ends at or after `start` ends (the
    index after it), or None: natural text never repeats a token that often."""
    if run <= 0:
        return None
    count, prev = 0, None
    for i in range(max(start - run + 1, 0), len(output)):
        count = count + 1 if output[i] == prev else 1
        prev = output[i]
        if count >= run and i >= start:
            return i + 1
    return None


@dataclass
class CanvasScheduler(Scheduler):
    settings: DiffusionSettings | None = None
    # a canvas request's prompt rows are planned with its canvas: each prefills its own
    shares_prompts: ClassVar[bool] = False
    streams: dict[int, mx.array] = field(default_factory=dict)  # seq id -> random stream
    canvases_committed: int = 0
    steps_run: int = 0  # denoising forwards of canvases (repairs included)
    compacted_rows: int = 0  # of which forwarded only a canvas's live positions

    def kv_need(self, seq: Sequence) -> int:
        # the prompt, every committed token, and a forward's encoded canvas + new canvas
        return len(seq.prompt) + seq.params.max_tokens + 2 * self.settings.canvas_length

    def shape_limits(self) -> ShapeLimits:
        # a prompt's last chunk and its first canvas share a forward row
        return ShapeLimits(
            max_rows=self.limits.max_running,
            max_width=self.limits.prefill_chunk + self.settings.canvas_length,
            max_positions=self.max_positions,
        )

    # ---- planning ------------------------------------------------------------------
    def plan(self, seq: Sequence, room: int | None = None) -> RowPlan:
        """`room` (speculative drafts) does not apply: a diffusion engine drafts nothing."""
        if seq.phase is not Phase.DECODE:
            chunk = plan_prefill(seq, self.limits.prefill_chunk)
            last = seq.prefilled + chunk.width == len(seq.prefill_tokens())
            if not last or seq.rebuild_to:
                return chunk  # a rebuilt history is followed by a canvas in its own row
            self._ensure_canvas(seq)
            return plan_canvas(seq, chunk.tokens)
        self._ensure_canvas(seq)
        canvas = seq.canvas
        turbo = self.settings.turbo
        if turbo.compact and canvas.live is not None and not canvas.repairing:
            # the model's canvas sets the buckets (a shorter last canvas caps them): the
            # same few widths for every canvas
            compacted = plan_compacted(seq, turbo.bucket_sizes(self.settings.canvas_length))
            if compacted is not None:
                self.compacted_rows += 1
                return compacted
        return plan_canvas(seq, [] if canvas.repairing else pending(seq))

    def _ensure_canvas(self, seq: Sequence) -> None:
        if seq.canvas is not None:
            return
        settings = self.settings
        stream = self.streams.get(seq.seq_id)
        if stream is None:
            stream = mx.random.key(seq.params.seed)
        length = settings.canvas_for(seq.params.max_tokens - len(seq.output))
        steps = seq.params.steps or settings.steps
        seq.canvas = new_canvas(length, steps, settings.vocab_size, stream)

    # ---- results -------------------------------------------------------------------
    def apply(
        self, plan: RowPlan, row: int, results: CanvasResults, _unused, _rows: int = 1
    ) -> list[int]:
        seq = plan.seq
        seq.kv_length += plan.keep
        if seq.phase is not Phase.DECODE:
            seq.prefilled += plan.keep
            if seq.prefilled < len(seq.prefill_tokens()):
                return []
            seq.phase = Phase.DECODE
            if seq.rebuild_to:
                seq.rebuild_to = 0
                return []
        if not plan.canvas:
            return []
        seq.forwards += 1
        self.steps_run += 1
        canvas: Canvas = seq.canvas
        final = self._advance(seq, canvas, results[row])
        if final is None:
            return []
        return self._commit(seq, final)

    def _advance(self, seq: Sequence, canvas: Canvas, out: dict[str, np.ndarray]):
        """Take one step's results; the canvas's committed tokens once it is done."""
        n = canvas.length
        argmax = out["argmax"][:n]
        if canvas.repairing:  # the repair forward: its argmax is the canvas
            return argmax
        canvas.taken += 1
        turbo = seq.params.sampler == "turbo"
        if canvas.step < 1 and not turbo:  # the reference's last step: argmax only
            return argmax
        before = canvas.revealed
        canvas.tokens = out["tokens"][:n].astype(np.int32)
        canvas.draft = out["draft"][:n].astype(np.int32)
        canvas.revealed = out["revealed"][:n].astype(bool)
        if turbo:  # the next step computes what is open, and what this step revealed
            canvas.live = ~canvas.revealed | (canvas.revealed & ~before)
        drained = bool(canvas.revealed.all())
        if turbo:
            if drained or canvas.step < 1:
                if self.settings.turbo.repair:
                    canvas.repairing = True
                    canvas.tokens = canvas.draft.copy()
                    return None
                return canvas.draft
            return None
        if drained:
            return argmax
        if self._stable(canvas, argmax, out):
            return argmax
        return None

    def _stable(self, canvas: Canvas, argmax: np.ndarray, out: dict[str, np.ndarray]) -> bool:
        """The reference's stopping rule (when the generation config sets one): the argmax
        canvas unchanged for `stability` steps and the mean entropy below the bound."""
        if self.settings.stability is None:
            return False
        run, bound = self.settings.stability
        stable = len(canvas.history) == run and all(
            np.array_equal(argmax, h) for h in canvas.history
        )
        canvas.history.append(argmax.copy())
        if len(canvas.history) > run:
            canvas.history.pop(0)
        return stable and float(out["entropy"]) < bound

    def _commit(self, seq: Sequence, tokens: np.ndarray) -> list[int]:
        before = len(seq.output)
        self.streams[seq.seq_id] = seq.canvas.key
        seq.canvas = None
        seq.canvases += 1
        self.canvases_committed += 1
        end = seq.commit([int(t) for t in tokens])
        if seq.params.sampler == "turbo":
            repeat = repeat_end(seq.output, before, self.settings.turbo.repeat_guard)
            if repeat is not None:  # the repeat guard: degenerate text ends the request
                del seq.output[repeat:]
                end = Phase.STOPPED
        if end is not None:
            seq.phase = end
            self.streams.pop(seq.seq_id, None)
        return seq.output[before:]

    def reap(self, in_flight: set[int]) -> list[Sequence]:
        done = super().reap(in_flight)
        for seq in done:
            self.streams.pop(seq.seq_id, None)
        return done

    def fail_all(self) -> list[Sequence]:
        self.streams.clear()
        return super().fail_all()
