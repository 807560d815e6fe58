"""What one token costs in each layer's KV, read from mlx-lm's own layers.

Families store different things per token: full heads of keys and values (most), MLA's
compressed latent and one rope key (DeepSeek V3, Kimi: kv_lora_rank + qk_rope_head_dim,
not heads x head_dim), wider heads on global layers than on local ones (Gemma 4), or
nothing in a layer that reuses another layer's KV. Rather than a table of config fields,
each layer of the family's mlx-lm model is called once on one token with a cache that
records what the layer hands it and stops there. MLX builds graphs lazily and knows
shapes before computing: the model's parameters are never materialized, nothing runs.
This engine's cache keeps every position of a sliding-window layer (its mask hides the
old ones), so such a layer costs per token what a full-attention layer does."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import mlx.core as mx

if TYPE_CHECKING:
    from common.model_config import ModelConfig

# Per layer, the (heads, dim) of each tensor its cache stores for one token; () for a
# layer that stores none (it shares another layer's KV, or keeps recurrent state).
KVShape = tuple[tuple[int, int], ...]

_SHAPES: dict[tuple[str, str], tuple[KVShape, ...]] = {}


class _Stored(Exception):
    def __init__(self, shape: KVShape) -> None:
        super().__init__("stored")
        self.shape = shape


class _Recorder:
    """Duck-types mlx-lm's KVCache far enough for a layer to reach its first write."""

    offset = 0
    keys = values = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        raise _Stored(tuple((int(a.shape[1]), int(a.shape[-1])) for a in (keys, values)))


def heads_shape(config: ModelConfig) -> KVShape:
    """Keys and values of every KV head, as the config's fields describe them (families
    whose layers cannot be probed, diffusion models)."""
    raw = config.raw
    heads = int(raw.get("num_attention_heads") or 1)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    dim = int(raw.get("head_dim") or config.hidden_size // heads)
    return ((kv_heads, dim), (kv_heads, dim))


def kv_token_shapes(config: ModelConfig) -> tuple[KVShape, ...]:
    """Per layer (0..num_layers-1), what its cache stores for one token."""
    key = (str(config.path), config.identity)
    if key not in _SHAPES:
        _SHAPES[key] = _probe(config)
    return _SHAPES[key]


def _probe(config: ModelConfig) -> tuple[KVShape, ...]:
    from common.model_families import find_layers

    fallback = (heads_shape(config),) * config.num_layers
    if config.diffusion:
        return fallback
    try:
        arch = importlib.import_module(f"mlx_lm.models.{config.family}")
        model = arch.Model(arch.ModelArgs.from_dict(config.mlx_args()))
        layers = find_layers(model, config.family).layers
        caches = _caches(model, config.family, len(layers))
    except Exception:  # the load itself names what is wrong; here a formula is enough
        return fallback
    x = mx.zeros((1, 1, config.hidden_size), mx.float32)
    shapes: list[KVShape] = []
    for layer, cache in zip(layers, caches, strict=False):
        if not cache:
            shapes.append(())  # recurrent state or another layer's KV: no KV per token
            continue
        try:
            layer(x, None, cache=_Recorder())
        except _Stored as stored:
            shapes.append(stored.shape)
        except Exception:  # a layer called otherwise (extra inputs): the config's heads
            shapes.append(heads_shape(config))
        else:
            shapes.append(())  # it never wrote a cache
    shapes += [heads_shape(config)] * (config.num_layers - len(shapes))
    return tuple(shapes[: config.num_layers])


def _caches(model: Any, family: str, num_layers: int) -> list[bool]:
    """Per layer, whether mlx-lm gives it an attention KV cache of its own (layers past
    the end of make_cache()'s list share an earlier layer's, as Gemma 4's do)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from common.errors import CheckpointError
    from common.model_families import layer_caches

    try:  # each layer's own kind: a hybrid's caches skip its cacheless layers (Nemotron-H)
        return [c.cached and not c.recurrent for c in layer_caches(model, family, num_layers)]
    except CheckpointError:
        pass

    make = getattr(model, "make_cache", None)
    if make is None:
        return [True] * num_layers
    made = make()
    kinds = [type(c) in (KVCache, RotatingKVCache) for c in made]
    return kinds + [False] * (num_layers - len(kinds))
