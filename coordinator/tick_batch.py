"""Stack the row plans of one tick into padded arrays: one row of the KV cache per sequence,
windows padded to a common width, head slots padded to a common count."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from common.window_mask import batch_window_masks
from coordinator.row_plan import RowPlan

WIDTH_STEP = 8  # batched window widths are padded to multiples of this (bounded shapes)


@dataclass
class TickBatch:
    plans: list[RowPlan | None]  # one entry per KV row; None = the row idles this tick
    tokens: np.ndarray  # [B, T]
    windows: np.ndarray  # [B, T, T]
    keeps: np.ndarray  # [B]
    head_slots: np.ndarray  # [B, K]
    head_is_mask: np.ndarray  # [B, K]

    @property
    def wants_head(self) -> bool:
        return self.head_slots.shape[1] > 0

    def sampling_arrays(self) -> dict[str, mx.array]:
        """Per-row decoding parameters as device arrays (idle rows get neutral values)."""
        rows = [p.seq.params if p else None for p in self.plans]
        ar = float("inf")  # an AR row fills its single slot: adj < inf always holds

        def col(get, default, dtype):
            return mx.array([get(r) if r else default for r in rows], dtype=dtype)

        return {
            "threshold": col(
                lambda r: ar if r.mode == "ar" else (r.threshold or -float("inf")),
                0.0,
                mx.float32,
            ),
            "penalty": col(lambda r: r.penalty, 0.0, mx.float32),
            "temperature": col(lambda r: r.temperature, 0.0, mx.float32),
            "top_k": col(lambda r: r.top_k, 0, mx.int32),
            "top_p": col(lambda r: r.top_p, 1.0, mx.float32),
            "seed": mx.array([r.seed if r else 0 for r in rows], dtype=mx.uint32),
            "counter": mx.array([p.seq.forwards if p else 0 for p in self.plans], dtype=mx.uint32),
        }

    @property
    def any_sampling(self) -> bool:
        return any(p and p.head_slots.size and p.seq.params.temperature > 0 for p in self.plans)

    @property
    def any_filter(self) -> bool:
        return any(
            p and p.seq.params.temperature > 0 and (p.seq.params.top_k or p.seq.params.top_p < 1)
            for p in self.plans
        )

    @property
    def any_wedlm(self) -> bool:
        return any(p and p.head_slots.size and p.seq.params.mode == "wedlm" for p in self.plans)


def build_batch(plans: list[RowPlan | None]) -> TickBatch:
    active = [p for p in plans if p is not None]
    width = max(p.width for p in active)
    if len(plans) > 1:
        width = -(-width // WIDTH_STEP) * WIDTH_STEP
    heads = max(p.head_slots.size for p in active)
    b = len(plans)
    tokens = np.zeros((b, width), dtype=np.int32)
    keeps = np.zeros(b, dtype=np.int64)
    head_slots = np.zeros((b, heads), dtype=np.int64)
    head_is_mask = np.zeros((b, heads), dtype=bool)
    filled_rows = []
    for i, p in enumerate(plans):
        if p is None:
            filled_rows.append(np.zeros(0, dtype=bool))
            continue
        tokens[i, : p.width] = p.tokens
        keeps[i] = p.keep
        head_slots[i, : p.head_slots.size] = p.head_slots
        head_is_mask[i, : p.head_is_mask.size] = p.head_is_mask
        filled_rows.append(p.filled)
    windows = batch_window_masks(filled_rows, width)
    return TickBatch(plans, tokens, windows, keeps, head_slots, head_is_mask)
