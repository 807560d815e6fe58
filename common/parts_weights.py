"""Putting checkpoint weights into a module of model parts: quantizing it as config.json
says, then loading and materializing the weights. A leaf: model_parts.py and
diffusion/parts.py both import it, and it imports neither."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from common.errors import CheckpointError


def quantize_parts(parts: nn.Module, quant: dict[str, Any], predicate) -> None:
    """Quantize the modules `predicate` picks with a config.json's `quantization` defaults."""
    nn.quantize(
        parts,
        group_size=quant["group_size"],
        bits=quant["bits"],
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def install_weights(parts: nn.Module, weights: dict[str, mx.array], path: Path) -> None:
    """Load exactly these weights into `parts` and materialize them (float32 on a CPU)."""
    try:
        parts.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{path}: weights do not match config.json: {e}") from None
    parts.eval()
    if mx.default_device() == mx.cpu:
        # MLX's CPU backend emulates float16/bfloat16 arithmetic (tens of times slower);
        # compute in float32 there. GPUs keep the checkpoint's dtype.
        parts.set_dtype(mx.float32)
    mx.eval(parts.parameters())
