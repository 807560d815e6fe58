"""How a process stores keys and values: the model's dtype, or quantized to 8 or 4 bits in
groups along the head dimension (mlx's affine quantization, mlx-lm's quantized attention).
The coordinator chooses it (--kv-bits) and every stage stores its KV the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import WedlmError

if TYPE_CHECKING:  # the client install imports this module (the CLI's choices), without MLX
    import mlx.core as mx

    from common.layer_range import LayerRange
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
        """Refuse a group size that does not divide every row the layers store (their
        head dimension; MLA's latent and rope key widths)."""
        if not self.quantized:
            return
        from common.layer_kv import kv_token_shapes

        stored = {dim for shape in kv_token_shapes(config) for _, dim in shape}
        dims = sorted(stored or {head_dim(config)})
        if any(dim % self.group_size for dim in dims):
            fits = [g for g in KV_GROUP_SIZES if all(dim % g == 0 for dim in dims)]
            what = "head dimension" if len(dims) == 1 else "stored widths"
            raise WedlmError(
                f"kv group size {self.group_size} does not divide this model's {what} "
                f"{', '.join(map(str, dims))}: choose one of "
                f"{', '.join(map(str, fits)) or 'none'}"
            )

    def bytes_per_token(
        self, config: ModelConfig, dtype: mx.Dtype, layers: int | LayerRange
    ) -> int:
        """Keys and values of one token across `layers`, as stored: each layer's own
        (common/layer_kv.py reads them from mlx-lm's layers). A count of layers costs
        that many of the model's average layer (rounded up); a range, its own layers."""
        per_layer = self.layer_bytes_per_token(config, dtype)
        if isinstance(layers, int):
            return -(-sum(per_layer) * max(1, layers) // len(per_layer))
        return sum(per_layer[i] for i in layers)

    def layer_bytes_per_token(self, config: ModelConfig, dtype: mx.Dtype) -> tuple[int, ...]:
        """Per layer of the model, the bytes one token's keys and values take in it."""
        from common.layer_kv import kv_token_shapes

        return tuple(
            sum(heads * self._row_bytes(dim, dtype) for heads, dim in shape)
            for shape in kv_token_shapes(config)
        )

    def _row_bytes(self, dim: int, dtype: mx.Dtype) -> int:
        """One head's row of `dim` values: packed words plus a scale and a bias per group
        when quantized, else `dim` values in dtype."""
        if self.quantized:
            return dim * self.bits // 8 + 2 * (-(-dim // self.group_size)) * dtype.size
        return dim * dtype.size

    def label(self) -> str:
        return f"{self.bits}-bit (groups of {self.group_size})" if self.quantized else "full"


FULL = KVFormat()
