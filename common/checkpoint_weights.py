"""Find a checkpoint's safetensors and read only the tensors a layer range needs (lazily)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from common.errors import CheckpointError

# A transformer layer's tensors: `model.layers.N.` (mlx-lm families), a multimodal
# checkpoint's text layers (`language_model.model.layers.N.` as mlx-lm names them,
# `model.language_model.layers.N.` as transformers saves them), and DiffusionGemma's
# decoder layers and their encoder-side scalars (`model.decoder.layers.N.`,
# `model.encoder.language_model.layers.N.`), and a Mamba hybrid's (`backbone.layers.N.`).
_LAYER_KEY = re.compile(
    r"^(?:model\.(?:decoder\.|encoder\.language_model\.|language_model\.)?"
    r"|language_model\.model\.|backbone\.)layers\.(\d+)\."
)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights (model*.safetensors) in {path}")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f} is listed in the safetensors index but missing")
    return files


def layer_of(key: str) -> int | None:
    m = _LAYER_KEY.match(key)
    return int(m.group(1)) if m else None


def split_layer_key(key: str) -> tuple[int, str] | None:
    """(layer, the name inside the layer) of a layer tensor's key, else None."""
    m = _LAYER_KEY.match(key)
    return (int(m.group(1)), key[m.end() :]) if m else None


def load_tensors(path: Path, wanted: Callable[[str], bool]) -> dict[str, mx.array]:
    """Tensors whose names pass `wanted`. mx.load maps files lazily: nothing else is read."""
    tensors: dict[str, mx.array] = {}
    for f in weight_files(path):
        try:
            contents = mx.load(str(f))
        except Exception as e:  # MLX raises RuntimeError/ValueError with terse texts
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
        tensors.update({k: v for k, v in contents.items() if wanted(k)})
    return tensors


def layer_nbytes(path: Path, layer: int = 0) -> int:
    """Bytes of one transformer layer's weights as stored (shapes only; nothing is read)."""
    return sum(v.nbytes for v in load_tensors(path, lambda k: layer_of(k) == layer).values())


def layer_file_name(layer: int) -> str:
    """The file one layer's tensors take in a cache folder of fetched layers (a checkpoint
    folder that `weight_files` reads like any other)."""
    return f"model-layer-{layer:05d}.safetensors"
