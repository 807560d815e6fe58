"""One rotary-embedding call for queries and keys together, where q/k/v are one fused
product (common/fused_projections.py). Issue 35.

mlx-lm's llama and qwen2 attention apply the rotary embedding to the queries, then to the
keys: two kernels per layer. With q/k/v fused, the product's heads are [q | k | v], so the
first Hq + Hkv heads are the queries and keys side by side, at the same positions, and one
rope call over them gives both (it rotates every head alike, each by its row's position).
On an H200 a rope call costs the host 10-18 us, and one call instead of two per layer took
a one-row forward of the 30-layer r2 from 3.46 to 3.23 ms; a 16-row one did not move
(RESULTS SC15). The results are bit for bit those of mlx-lm's code: the same kernel
computes the same values, only over more heads at once.

Only the families whose attention is exactly mlx-lm's llama/qwen2 code, with no q/k norm
between projection and rope, take it; any other attention keeps its own `__call__`."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# mlx-lm modules whose Attention.__call__ is: project, reshape, rope(q), rope(k), cache
# update, attention, o_proj (llama, mistral and their kin; qwen2 the same with biases)
FAMILIES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")


def _one_rope_call(self: nn.Module, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    b, length, _ = x.shape
    hq, hkv = self.n_heads, self.n_kv_heads
    # [B, L, (Hq + 2 Hkv) * D] -> [B, Hq + 2 Hkv, L, D]: views, as mlx-lm's reshapes are
    heads = self.qkv_proj(x).reshape(b, length, hq + 2 * hkv, -1).transpose(0, 2, 1, 3)
    qk, values = heads[:, : hq + hkv], heads[:, hq + hkv :]
    qk = self.rope(qk, offset=cache.offset) if cache is not None else self.rope(qk)
    queries, keys = qk[:, :hq], qk[:, hq:]
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    # the family module's function, looked up per call: small_query_attention.install
    # replaces it there
    attend = self._family.scaled_dot_product_attention
    out = attend(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


_classes: dict[type, type] = {}


def _with_one_rope_call(cls: type) -> type:
    """A subclass of mlx-lm's attention class whose `__call__` ropes q and k at once."""
    if cls not in _classes:
        # the family's module name stays: code that finds a layer's family by its
        # attention's class (its scaled_dot_product_attention) finds the same one
        body = {"__call__": _one_rope_call, "__module__": cls.__module__,
                "_family": sys.modules[cls.__module__]}  # fmt: skip
        _classes[cls] = type(cls.__name__, (cls,), body)
    return _classes[cls]


def adopt(module: nn.Module) -> bool:
    """Give `module` the one-rope-call `__call__` if it is a supported family's attention
    whose q/k/v were fused. Its parameters and their names stay as they are."""
    cls = type(module)
    if cls.__call__ is _one_rope_call:
        return True
    if cls.__name__ != "Attention" or cls.__module__ not in FAMILIES:
        return False
    if "qkv_proj" not in module or not hasattr(module, "rope"):
        return False
    module.__class__ = _with_one_rope_call(cls)
    return True
