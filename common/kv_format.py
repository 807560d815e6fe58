"""How a process stores keys and values: the model's dtype, or quantized to 8 or 4 bits in
groups along the head dimension (mlx's affine quantization, mlx-lm's quantized attention).
The coordinator chooses it (--kv-bits) and every stage stores its KV the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import WedlmError

if TYPE_CHECKING:  # the client install imports this module (the CLI's choices), without MLX
    import mlx.core as mx

    from common.model_config import ModelConfig

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


def head_dim(config: ModelConfig) -> int:
    raw = config.raw
    heads = int(raw.get("num_attention_heads") or 1)
    return int(raw.get("head_dim") or config.hidden_size // heads)


@dataclass(frozen=True)
class KVFormat:
    bits: int | None = None  # None: the model's dtype
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits is None:
            return  # the model's dtype: the group size means nothing
        if self.bits not in KV_BITS:
            raise WedlmError(
                f"kv bits must be one of {', '.join(map(str, KV_BITS))}, got {self.bits}"
            )
        if self.group_size not in KV_GROUP_SIZES:
            raise WedlmError(
                f"kv group size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                f"got {self.group_size}"
            )

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def check(self, config: ModelConfig) -> None:
        """Refuse a group size that does not divide the model's head dimension."""
        dim = head_dim(config)
        if self.quantized and dim % self.group_size:
            raise WedlmError(
                f"kv group size {self.group_size} does not divide this model's head "
                f"dimension {dim}: choose one of "
                f"{', '.join(str(g) for g in KV_GROUP_SIZES if dim % g == 0) or 'none'}"
            )

    def bytes_per_token(self, config: ModelConfig, dtype: mx.Dtype, layers: int) -> int:
        """Keys and values of one token across `layers` layers, as stored."""
        raw = config.raw
        heads = int(raw.get("num_attention_heads") or 1)
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        dim = head_dim(config)
        if self.quantized:  # packed values plus a scale and a bias per group, in dtype
            per_head = dim * self.bits // 8 + 2 * (dim // self.group_size) * dtype.size
        else:
            per_head = dim * dtype.size
        return 2 * kv_heads * per_head * max(1, layers)

    def label(self) -> str:
        return f"{self.bits}-bit (groups of {self.group_size})" if self.quantized else "full"


FULL = KVFormat()
