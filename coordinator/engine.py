"""The decoding engine: one tick is schedule → run → postprocess, and postprocess is the
only place a sequence changes state. The engine owns MLX in its process (call it from one
thread), holds the embedding and the head, and drives the layers through a Pipeline."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from common.errors import InvalidRequest
from common.model_parts import ModelParts
from coordinator.generation_params import GenerationParams
from coordinator.pipeline import Pipeline
from coordinator.row_plan import RowPlan, apply_result, plan_next
from coordinator.sampling import sample_tokens
from coordinator.selection import entropy, select_fills
from coordinator.sequence import Phase, Sequence
from coordinator.tick_batch import TickBatch, build_batch

PREFILL_CHUNK = 512


@dataclass
class Commit:
    seq: Sequence
    tokens: list[int]  # newly committed this tick (may be empty when only finishing)


class Engine:
    def __init__(
        self,
        parts: ModelParts,
        pipeline: Pipeline,
        num_rows: int,
        text_tail: Callable[[list[int]], str] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        stop_ids: tuple[int, ...] = (),
    ) -> None:
        self.parts = parts
        self.config = parts.config
        self.pipeline = pipeline
        self.max_running = num_rows
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.text_tail = text_tail
        self.prefill_chunk = prefill_chunk
        self._next_id = 0
        # The model's EOS ids and the tokenizer's chat end tokens always stop.
        self.model_stop_ids = tuple(dict.fromkeys(self.config.eos_token_ids + tuple(stop_ids)))

    # ---- requests -------------------------------------------------------------------
    def submit(self, prompt: list[int], params: GenerationParams) -> Sequence:
        self.validate_prompt(prompt, params)
        params = replace(params, extra_stop_ids=self.model_stop_ids)
        seq = Sequence(self._next_id, list(prompt), params, text_tail=self.text_tail)
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def validate_prompt(self, prompt: list[int], params: GenerationParams) -> None:
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if params.mode == "wedlm" and not 0 <= self.config.mask_token_id < vocab:
            raise InvalidRequest(
                f"WeDLM mode needs a mask token, but mask_token_id "
                f"{self.config.mask_token_id} is outside this model's vocabulary of {vocab} "
                f"(set mask_token_id in config.json, or use --mode ar)"
            )
        room = 2 * params.window if params.mode == "wedlm" else 1
        limit = self.config.max_position_embeddings
        if len(prompt) + room > limit:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; with a window of {room} rows it "
                f"exceeds the model's context of {limit} positions"
            )

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    # ---- one tick -------------------------------------------------------------------
    def step(self) -> list[Commit]:
        self._admit()
        commits: list[Commit] = []
        plans = self._schedule(commits)
        if plans:
            start = time.perf_counter()
            batch = build_batch(plans)
            fills, tokens = self._run(batch)
            elapsed = time.perf_counter() - start
            commits += self._postprocess(batch, fills, tokens, elapsed)
        done = [s for s in self.running if s.finished]
        if done:
            self.running = [s for s in self.running if not s.finished]
            self.pipeline.release([s.seq_id for s in done])
        return commits

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            new = self.waiting.popleft()
            new.phase = Phase.PREFILL
            self.running.append(new)

    def _schedule(self, commits: list[Commit]) -> list[RowPlan]:
        """Plans for this tick. Prefill ticks and decode ticks alternate rather than mix, so
        a long prompt chunk does not pad every decode window to its width."""
        prefilling = any(s.phase is Phase.PREFILL for s in self.running)
        plans: list[RowPlan] = []
        limit = self.config.max_position_embeddings
        for seq in self.running:
            if prefilling and seq.phase is not Phase.PREFILL:
                continue
            plan = plan_next(seq, self.config.mask_token_id, self.prefill_chunk)
            if plan.commits and seq.would_finish(plan.commits):
                # The tokens that end the sequence are known: no forward is needed.
                before = len(seq.output)
                seq.commit(plan.commits)
                seq.phase = Phase.FINISHED
                commits.append(Commit(seq, seq.output[before:]))
            elif seq.kv_length + plan.width > limit:
                seq.finish_reason = "length"
                seq.phase = Phase.FINISHED
                commits.append(Commit(seq, []))
            else:
                plans.append(plan)
        return plans

    def _run(self, batch: TickBatch) -> tuple[np.ndarray, np.ndarray]:
        """Embed, run the layers, and select/sample on the device; one host sync."""
        hidden = self.parts.embed(mx.array(batch.tokens))
        hidden = self.pipeline.forward(batch.spec, hidden)
        if not batch.wants_head:
            mx.eval(hidden)
            return np.zeros((len(batch.plans), 0), bool), np.zeros((len(batch.plans), 0))
        slots = mx.array(batch.head_slots)
        picked = mx.take_along_axis(hidden, slots[:, :, None], axis=1)
        logits = self.parts.head(picked).astype(mx.float32)
        arrays = batch.sampling_arrays()
        is_mask = mx.array(batch.head_is_mask)
        if batch.any_wedlm:
            ent = entropy(logits)
        else:
            ent = mx.zeros(is_mask.shape, dtype=mx.float32)
        fills = select_fills(ent, is_mask, arrays["threshold"], arrays["penalty"])
        tokens = sample_tokens(
            logits,
            arrays["temperature"],
            arrays["top_k"],
            arrays["top_p"],
            arrays["seed"],
            arrays["counter"],
            any_sampling=batch.any_sampling,
            any_filter=batch.any_filter,
        )
        mx.eval(fills, tokens)
        return np.array(fills), np.array(tokens)

    def _postprocess(
        self, batch: TickBatch, fills: np.ndarray, tokens: np.ndarray, elapsed: float
    ) -> list[Commit]:
        commits = []
        for i, plan in enumerate(batch.plans):
            seq = plan.seq
            k = plan.head_slots.size
            was_prefill = seq.phase is Phase.PREFILL
            new = apply_result(plan, fills[i, :k], tokens[i, :k])
            if was_prefill:
                seq.prefill_s += elapsed
            else:
                seq.decode_s += elapsed
            if new or seq.finished:
                commits.append(Commit(seq, new))
        return commits

    def cancel(self, seq: Sequence) -> None:
        """Finish a sequence now (client gone or job cancelled) and free its KV."""
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason = "cancelled"
        seq.phase = Phase.FINISHED
        if seq in self.running:
            self.running.remove(seq)
            self.pipeline.release([seq.seq_id])

    def fail_running(self, reason: str) -> list[Sequence]:
        """Finish every running sequence with an error (their KV state is unknown)."""
        failed = list(self.running)
        for seq in failed:
            seq.finish_reason = "error"
            seq.phase = Phase.FINISHED
        self.running = []
        return failed

    # ---- convenience ------------------------------------------------------------------
    def stream(self, seqs: list[Sequence]) -> Iterator[Commit]:
        """Tick until these sequences finish, yielding their commits as they happen."""
        wanted = {s.seq_id for s in seqs}
        while any(not s.finished for s in seqs):
            for c in self.step():
                if c.seq.seq_id in wanted:
                    yield c
