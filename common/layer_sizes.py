"""Bytes a layer and a token of KV cost on this worker: what the coordinator's planner needs
to split layers by memory. A worker still waiting for its range estimates the weights from
the safetensors headers (a few KB read per file, no tensor data)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from common.checkpoint_weights import layer_of, weight_files
from common.errors import CheckpointError
from common.kv_format import FULL, KVFormat
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.model_parts import ModelParts

DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# safetensors dtype -> (bytes per element, is floating point)
_ST_DTYPES = {
    "F64": (8, True),
    "F32": (4, True),
    "F16": (2, True),
    "BF16": (2, True),
    "I64": (8, False),
    "U64": (8, False),
    "I32": (4, False),
    "U32": (4, False),
    "I16": (2, False),
    "U16": (2, False),
    "I8": (1, False),
    "U8": (1, False),
    "BOOL": (1, False),
    "F8_E4M3": (1, False),
    "F8_E5M2": (1, False),
}


def compute_dtype(config: ModelConfig) -> mx.Dtype:
    """The dtype layers run in, as load_model_parts leaves them: float32 on the CPU
    (MLX emulates 16-bit arithmetic there), else the checkpoint's own."""
    if mx.default_device().type == mx.cpu:
        return mx.float32
    name = str(config.raw.get("torch_dtype") or config.raw.get("dtype") or "bfloat16")
    return _BY_NAME.get(name, mx.bfloat16)


def parts_dtype(parts: ModelParts) -> mx.Dtype:
    """The floating dtype of the loaded layers (quantized weights are integers; skip them)."""
    for _, p in tree_flatten(parts.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


def loaded_layer_bytes(parts: ModelParts) -> int:
    total = sum(p.nbytes for _, p in tree_flatten(parts.parameters()))
    return total // max(1, len(parts.layers))


def _header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            return json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def layer_weight_bytes(config: ModelConfig, dtype: mx.Dtype | None = None) -> tuple[int, ...]:
    """Per layer (0..num_layers-1), the bytes of its weights from the safetensors headers:
    floating tensors in `dtype` (None: as stored), others as stored. Layers past
    num_hidden_layers (DeepSeek's and GLM's multi-token-prediction layers, which mlx-lm's
    sanitize drops) are neither loaded nor counted."""
    sizes = [0] * config.num_layers
    for path in weight_files(config.path):
        for key, entry in _header(path).items():
            layer = layer_of(key) if key != "__metadata__" else None
            if layer is None or layer >= config.num_layers:
                continue
            start, end = entry["data_offsets"]
            size, floating = _ST_DTYPES.get(entry["dtype"], (1, False))
            scaled = dtype is not None and floating
            sizes[layer] += (end - start) // size * dtype.size if scaled else end - start
    return tuple(sizes)


def estimated_layer_bytes(config: ModelConfig, dtype: mx.Dtype) -> int:
    """Average bytes of one layer once loaded: floating tensors in `dtype`, others as stored."""
    return sum(layer_weight_bytes(config, dtype)) // config.num_layers


def kv_bytes_per_token(
    config: ModelConfig, dtype: mx.Dtype, layers: int | LayerRange, kv: KVFormat = FULL
) -> int:
    """Keys and values of one token across `layers` (a count of average layers, or a
    range of the model's own), as `kv` stores them."""
    return kv.bytes_per_token(config, dtype, layers)
