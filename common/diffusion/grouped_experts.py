"""DiffusionGemma's experts with the token-expert pairs grouped by expert: each expert's
rows form one matrix ([E, C, H], C rows of capacity) and one gather matmul per projection
multiplies every expert's matrix by its weights, so each expert's weights are read once
per forward. mlx-vlm's experts gather one row per pair (sorted by expert); MLX's CUDA
backend then reads an expert's weights for every pair, so a step's MoE time grows with its
tokens (a canvas of 256 x top-8 = 2048 pairs: 5.2 ms a layer on an H100, 1.3 ms grouped;
8 canvases: 38 vs 4.4 ms; benchmarks/moe_experts.py). The outputs are identical.

The capacity (the busiest expert's pairs, rounded up to a few sizes) is read back once per
layer: a host sync that costs far less than it saves on CUDA. On Apple GPUs MLX's sorted
gather already runs a weight-reusing kernel, and on the CPU the per-pair path is faster,
so grouping is for CUDA only (WEDLM_MOE_GROUPED=1/0 overrides)."""

from __future__ import annotations

import mlx.core as mx

from common.diffusion.mlx_vlm_modules import diffusion_gemma
from common.env_switches import MOE_GROUPED

GROUP_FROM = 64  # pairs; fewer go the per-pair way (as mlx-vlm sorts only from 64)


def grouping_enabled() -> bool:
    forced = MOE_GROUPED.read()
    if forced in ("0", "1"):
        return forced == "1"
    return mx.default_device().type == mx.gpu and not mx.metal.is_available()


def capacity_bucket(busiest: int) -> int:
    """Rows per expert, rounded up to multiples of 8 to 32, then steps of 1.5x / 2x (a
    bounded set of shapes)."""
    if busiest <= 32:
        return max(8, -(-busiest // 8) * 8)
    size = 32
    while size < busiest:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def grouped_experts_class():
    experts_cls = diffusion_gemma().language.Experts

    class GroupedExperts(experts_cls):
        """mlx-vlm's Experts (same parameters), grouped by expert when it pays."""

        def __call__(self, x: mx.array, top_k_indices: mx.array) -> mx.array:
            if top_k_indices.size < GROUP_FROM or not grouping_enabled():
                return super().__call__(x, top_k_indices)
            n, k = top_k_indices.shape
            e = self.gate_up_proj.num_experts
            flat = top_k_indices.reshape(-1)
            order = mx.argsort(flat)
            by_expert = flat[order]
            counts = (flat[:, None] == mx.arange(e)[None, :]).sum(axis=0)
            capacity = capacity_bucket(int(counts.max().item()))  # the one read-back
            starts = mx.cumsum(counts) - counts
            rank = mx.arange(n * k) - starts[by_expert]
            slot = by_expert * capacity + rank  # each sorted pair's row in [E * C]
            rows = mx.zeros((e * capacity, x.shape[-1]), x.dtype).at[slot].add(x[order // k])
            ids = mx.arange(e, dtype=mx.uint32)
            gate_up = self.gate_up_proj(rows.reshape(e, capacity, -1), ids)
            h = self.activation(gate_up[..., self.hidden_dims :], gate_up[..., : self.hidden_dims])
            y = self.down_proj(h, ids).reshape(e * capacity, -1)[slot]
            out = mx.zeros((n * k, y.shape[-1]), y.dtype).at[order].add(y)
            return out.reshape(n, k, -1)

    return GroupedExperts
