"""Where the transformer layers run. The engine hands each tick's hidden states to a
pipeline and gets the last layer's hidden states back; this one runs them in-process."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np

from common.kv_rows import KVRows
from common.model_parts import ModelParts, run_layers


class Pipeline(Protocol):
    def forward(self, hidden: mx.array, windows: np.ndarray, keeps: np.ndarray) -> mx.array:
        """Run all layers over [rows, T, H]; then make keeps[b] leading rows permanent."""

    def release_row(self, row: int) -> None:
        """Forget row's KV (its sequence finished); the row will be reused."""


class LocalPipeline:
    def __init__(self, parts: ModelParts, num_rows: int) -> None:
        self.parts = parts
        self.kv = KVRows(len(parts.layers), num_rows)

    def forward(self, hidden: mx.array, windows: np.ndarray, keeps: np.ndarray) -> mx.array:
        out = run_layers(self.parts, hidden, self.kv, windows)
        self.kv.commit(keeps)
        return out

    def release_row(self, row: int) -> None:
        self.kv.reset_row(row)
