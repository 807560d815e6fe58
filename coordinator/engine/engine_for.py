"""The engine a model decodes with: the WeDLM/AR/speculative engine, or the diffusion
engine for a block-diffusion model (DiffusionGemma)."""

from __future__ import annotations

from collections.abc import Callable

from common.errors import WedlmError
from common.model_parts import ModelParts
from coordinator.engine.engine import Engine
from coordinator.engine.pipeline import Pipeline
from coordinator.engine.prefix_cache import PrefixCache
from coordinator.engine.scheduler import Limits


def engine_for(
    parts: ModelParts,
    pipeline: Pipeline,
    num_rows: int,
    text_tail: Callable[[list[int]], str] | None = None,
    stop_ids: tuple[int, ...] = (),
    micro_batches: int = 1,
    limits: Limits | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Engine:
    if not parts.config.diffusion:
        return Engine(
            parts, pipeline, num_rows, text_tail, stop_ids, micro_batches, limits, prefix_cache
        )
    from coordinator.engine.diffusion.engine import DiffusionEngine

    # A diffusion request's KV ends with a canvas it never encoded: nothing to cache yet.
    # It stops where mlx-vlm stops: at the model's EOS ids (its generation config lists the
    # chat end tokens), not at every chat token of the tokenizer's.
    return DiffusionEngine(parts, pipeline, num_rows, text_tail, (), micro_batches, limits)


def check_draft_model(parts: ModelParts) -> None:
    if parts.config.diffusion:
        raise WedlmError("--draft-model drafts for speculative mode; a diffusion model has none")
