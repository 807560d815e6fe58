"""The engine for diffusion models. It is the decoding engine (engine.py: micro-batches in
flight, one host sync per micro-batch, the same pipeline of stages, recovery by re-prefill)
with the canvas scheduler, the canvas embedding (self-conditioning) and the diffusion
samplers in place of WeDLM selection and token sampling. Canvases of every request in a
micro-batch share one forward; a request's commit and prefill rows share it too."""

from __future__ import annotations

import time
from dataclasses import replace

import mlx.core as mx
import numpy as np

from common.diffusion.parts import DiffusionParts
from common.errors import InvalidRequest
from common.generation_params import GenerationParams
from common.modes import Mode
from coordinator.engine.diffusion.canvas import forwarded
from coordinator.engine.diffusion.reference_sampler import reference_step
from coordinator.engine.diffusion.scheduler import CanvasScheduler
from coordinator.engine.diffusion.settings import DiffusionSettings, load_settings
from coordinator.engine.diffusion.step_result import StepResult
from coordinator.engine.diffusion.turbo import turbo_step
from coordinator.engine.engine import Engine
from coordinator.engine.in_flight import InFlight, Ran
from coordinator.engine.pipeline import Pipeline
from coordinator.engine.scheduler import Commit, Limits, Scheduler, Unit
from coordinator.engine.sequence import Sequence
from coordinator.engine.tick_batch import TickBatch, build_batch


class DiffusionEngine(Engine):
    def __init__(
        self,
        parts: DiffusionParts,
        pipeline: Pipeline,
        num_rows: int,
        text_tail=None,
        stop_ids: tuple[int, ...] = (),
        micro_batches: int = 1,
        limits: Limits | None = None,
        settings: DiffusionSettings | None = None,
    ) -> None:
        self.settings = settings or load_settings(parts.config)
        # no prefix cache: a finished request's KV ends with a canvas it never encoded
        super().__init__(parts, pipeline, num_rows, text_tail, stop_ids, micro_batches, limits)

    def _new_scheduler(self, limits: Limits, micro_batches: int, prefix_cache=None) -> Scheduler:
        config = self.config
        return CanvasScheduler(
            limits,
            micro_batches,
            config.mask_token_id,
            config.max_position_embeddings,
            settings=self.settings,
        )

    # ---- requests ---------------------------------------------------------------------
    def resolve_drafts(self, params: GenerationParams) -> GenerationParams:
        return params

    def validate_prompt(self, prompt: list[int], params: GenerationParams) -> None:
        if params.mode != Mode.DIFFUSION:
            raise InvalidRequest(
                f"mode {params.mode!r} needs a WeDLM or autoregressive model: this model "
                f"({self.config.model_type}) decodes by diffusion (use mode diffusion or auto)"
            )
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if params.logprobs is not None:
            raise InvalidRequest("logprobs are not available in mode diffusion")
        if params.grammar is not None:
            raise InvalidRequest("structured output is not available in mode diffusion")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        limit = self.config.max_position_embeddings
        need = len(prompt) + params.max_tokens + self.settings.canvas_length
        if need > limit:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; with max_tokens {params.max_tokens} "
                f"and a canvas of {self.settings.canvas_length} it exceeds the model's "
                f"context of {limit} positions"
            )

    def submit(
        self, prompt: list[int], params: GenerationParams, shares_with: Sequence | None = None
    ) -> Sequence:
        """`shares_with` (another choice of an n > 1 request) is not used: a diffusion
        model's choices each prefill their prompt (its scheduler shares no prompt rows)."""
        params = self.resolve_mode(params)
        self.validate_prompt(prompt, params)
        params = replace(params, extra_stop_ids=self.model_stop_ids)
        seq = Sequence(next(self._ids), list(prompt), params, text_tail=self.text_tail)
        self.scheduler.add(seq)
        return seq

    # ---- one micro-batch ----------------------------------------------------------------
    def _launch(self, unit: Unit, plans) -> None:
        started = time.perf_counter()
        batch = build_batch(plans, padding_ids=self._padding_ids(unit, len(plans)))
        hidden = self._embed(batch)
        batch_id = next(self._batch_ids)
        self.shapes.record(batch.spec)
        self.pipeline.submit(batch_id, batch.spec, hidden, batch.reply_slots())
        self.in_flight.append(InFlight(batch_id, unit, plans, batch, started))

    def _embed(self, batch: TickBatch) -> mx.array:
        """Encoder slots: scaled embeddings; canvas slots: the same through the
        self-conditioning block, conditioned on their canvas's last step (zeros at its
        first, as the reference)."""
        parts: DiffusionParts = self.parts
        emb = parts.embed(mx.array(batch.tokens))
        spec = batch.spec
        if not spec.has_canvas:
            return emb
        b, t, h = emb.shape
        rows = []
        enc = spec.encoded()
        for i in range(b):
            plan = batch.plans[i] if i < len(batch.plans) else None
            cond = plan.seq.canvas.conditioning if plan is not None and plan.canvas else None
            if cond is not None and plan.offsets is not None:
                cond = cond[mx.array(plan.offsets)]
            if cond is None:
                rows.append(mx.zeros((t, h), emb.dtype))
                continue
            start = int(enc[i])
            rows.append(
                mx.concatenate(
                    [
                        mx.zeros((start, h), emb.dtype),
                        cond.astype(emb.dtype),
                        mx.zeros((t - start - cond.shape[0], h), emb.dtype),
                    ]
                )
            )
        canvas = parts.self_conditioning(emb, mx.stack(rows))
        slot = np.arange(t)[None, :]
        is_canvas = (slot >= enc[:, None]) & (slot < spec.widths[:, None])
        return mx.where(mx.array(is_canvas)[:, :, None], canvas, emb)

    def _complete(self, commits: list[Commit]) -> Ran:
        flight = self.in_flight.popleft()
        batch_id, hidden = self.pipeline.collect()
        assert batch_id == flight.batch_id, "micro-batches complete in order"
        steps = self._sample(flight.batch, hidden)
        arrays = [a for s in steps for a in s.arrays()]
        keys = [p.seq.canvas.key for p in flight.plans if p.canvas]
        mx.async_eval(arrays, keys)
        self._launch_other(commits)
        mx.eval(arrays, keys)  # the one host sync of this micro-batch
        self.forwards += 1
        results = {}
        for step in steps:
            host = step.host()
            for j, row in enumerate(step.rows):
                results[row] = {k: v[j] for k, v in host.items()}
                canvas = flight.plans[row].seq.canvas
                if step.conditioning is not None:
                    canvas.conditioning = step.conditioning[j, : canvas.length]
        return Ran(flight, results, None, ahead=False)

    def _sample(self, batch: TickBatch, hidden: mx.array) -> list[StepResult]:
        """One denoising step for every canvas row, by sampler: the reference's rows on
        full-vocabulary logits, the turbo rows on their top-K."""
        parts: DiffusionParts = self.parts
        by_sampler: dict[str, list[int]] = {"faithful": [], "turbo": []}
        for i, p in enumerate(batch.plans):
            if p.canvas:
                by_sampler[p.seq.params.sampler].append(i)
        faithful = by_sampler["faithful"]
        out = []
        for rows in by_sampler.values():
            if not rows:
                continue
            plans = [batch.plans[i] for i in rows]
            canvases = [p.seq.canvas for p in plans]
            width = max(p.canvas for p in plans)  # canvas slots forwarded
            h = hidden[mx.array(rows), :width] if len(rows) < hidden.shape[0] else hidden[:, :width]
            logits = parts.head_logits(h)
            if rows is faithful:
                step = reference_step(
                    parts,
                    self.settings,
                    canvases,
                    [p.seq.params.temperature for p in plans],
                    self.settings.threshold,
                    parts.softcap(logits),
                )
            else:
                step = turbo_step(
                    parts,
                    self.settings,
                    canvases,
                    self.model_stop_ids,
                    logits,
                    [c.repairing for c in canvases],
                    [forwarded(p) for p in plans],
                    [p.seq.params.temperature for p in plans],
                )
            step.rows = rows
            out.append(step)
        return out
