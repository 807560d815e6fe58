"""Where the transformer layers run. The engine hands each tick's hidden states and row
spec to a pipeline and gets the last layer's hidden states back; this one runs them
in-process (a cluster pipeline sends them through the workers instead)."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from common.layer_runner import LayerRunner
from common.model_parts import ModelParts
from common.rows_spec import RowsSpec


class Pipeline(Protocol):
    def forward(self, spec: RowsSpec, hidden: mx.array) -> mx.array:
        """Run all layers over hidden [rows, T, H]; then keep spec.keeps[b] rows as KV."""

    def release(self, seq_ids: list[int]) -> None:
        """Forget these sequences' KV everywhere."""


class LocalPipeline:
    def __init__(self, parts: ModelParts) -> None:
        self.runner = LayerRunner(parts)

    def forward(self, spec: RowsSpec, hidden: mx.array) -> mx.array:
        return self.runner.forward(spec, hidden)

    def release(self, seq_ids: list[int]) -> None:
        self.runner.release(seq_ids)
