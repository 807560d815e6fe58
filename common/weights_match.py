"""A checkpoint's tensors against the model config.json describes: a missing, extra or
misshapen tensor stops the load with one line naming the file, the tensor and what was
expected (mlx's own error names our internal parameter names, not the checkpoint's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from common.checkpoint_weights import weight_files
from common.errors import CheckpointError


def _file_of(path: Path, name: str) -> Path | str:
    """The safetensors file holding checkpoint tensor `name` (only read on an error)."""
    for f in weight_files(path):
        try:
            if name in mx.load(str(f)):
                return f
        except Exception:  # an unreadable file was refused before this runs
            continue
    return path


def check_weights(
    module: nn.Module,
    weights: dict[str, mx.array],
    path: Path,
    checkpoint_name: Callable[[str], str],
) -> None:
    """`weights` (local names) are exactly `module`'s parameters, shape for shape."""
    expected = dict(tree_flatten(module.parameters()))
    problem = "weights do not match config.json"
    for name in sorted(expected):
        if name not in weights:
            raise CheckpointError(
                f"{path}: {problem}: tensor {checkpoint_name(name)} is missing (config.json "
                f"describes it with shape {tuple(expected[name].shape)})"
            )
    for name in sorted(weights):
        theirs = checkpoint_name(name)
        if name not in expected:
            raise CheckpointError(
                f"{_file_of(path, theirs)}: {problem}: tensor {theirs} is not part of the "
                "model config.json describes"
            )
        want, got = tuple(expected[name].shape), tuple(weights[name].shape)
        if want != got:
            raise CheckpointError(
                f"{_file_of(path, theirs)}: {problem}: tensor {theirs} has shape {got}, "
                f"config.json expects {want}"
            )
