"""What the engine needs to know of an mlx-lm model family, read from mlx-lm itself.

A checkpoint's `model_type` is resolved through mlx-lm's own registry (`_get_classes`:
its MODEL_REMAPPING and architecture remapping), so a family is served when mlx-lm has
it. From the built model object this module finds the layer list (wherever the family
keeps it) and what each layer keeps between forwards, from mlx-lm's `make_cache()`: a
`KVCache` is full attention, a `RotatingKVCache(max_size=W)` a sliding window of W
positions, an `ArraysCache(size=n)` (MambaCache is one) the n arrays of a linear-attention
or state-space layer's recurrent state (common/recurrent_rows.py holds them per row)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.nn as nn

from common.errors import CheckpointError

# Cache classes this engine does not hold, named in the refusal by what they hold.
_STATE_NAMES = {
    "CacheList": "layers with several caches each (hybrid attention and recurrent state)",
    "ConcatenateKVCache": "layers whose cache is concatenated keys",
}


def mlx_lm_version() -> str:
    import mlx_lm

    return str(getattr(mlx_lm, "__version__", "?"))


def resolve_module(config: dict[str, Any], where: Path) -> ModuleType:
    """The mlx-lm module of this config's family, as mlx-lm's own loader picks it."""
    import importlib

    from mlx_lm.utils import _get_classes

    try:
        model_cls, _ = _get_classes(config)
    except ValueError:
        raise CheckpointError(
            f"{where}: unsupported model_type {config.get('model_type')!r}: mlx-lm "
            f"{mlx_lm_version()} has no model family of that name"
        ) from None
    return importlib.import_module(model_cls.__module__)


def family_name(config: dict[str, Any], where: Path) -> str:
    """The mlx-lm module name (`mlx_lm.models.<name>`) that runs this config."""
    return resolve_module(config, where).__name__.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class LayerList:
    """Where a built mlx-lm model keeps its decoder layers."""

    owner: nn.Module  # the module holding the list
    attr: str  # its attribute name on `owner`
    path: str  # dotted parameter path of the list ("model.layers")
    layers: list[nn.Module]


def find_layers(model: nn.Module, family: str) -> LayerList:
    """The model's layer list: mlx-lm's `layers` property names its layers; the list that
    holds them is found in the module tree (model.layers, layers, language_model...)."""
    target = getattr(model, "layers", None)
    if not isinstance(target, list) or not target:
        raise CheckpointError(f"mlx-lm's {family} model has no `layers` list this engine can find")
    found = _find_list(model, target, "")
    if found is None:
        raise CheckpointError(
            f"mlx-lm's {family} model's `layers` are not a list held by one of its modules"
        )
    owner, attr, path = found
    return LayerList(owner, attr, path, list(owner[attr]))


def _find_list(module: nn.Module, target: list, prefix: str):
    for name, child in module.items():
        path = f"{prefix}{name}"
        # the list itself, or a list of the same layers (`layers` may return a slice:
        # qwen3_moe's pipeline_layers)
        if child is target or (
            isinstance(child, list)
            and len(child) == len(target)
            and all(a is b for a, b in zip(child, target, strict=True))
        ):
            return module, name, path
        if isinstance(child, nn.Module):
            found = _find_list(child, target, f"{path}.")
            if found is not None:
                return found
    return None


@dataclass(frozen=True)
class LayerCache:
    """What one layer keeps between forwards, as mlx-lm's make_cache() says."""

    window: int | None = None  # attention: its sliding window (None: full attention)
    chunk: int | None = None  # attention in chunks of this many positions (Llama 4)
    state: int = 0  # recurrent: the arrays of its state (ArraysCache(size=n)); 0: none
    cached: bool = True  # False: the layer takes no cache (nemotron_h's MLP layers)

    @property
    def recurrent(self) -> bool:
        return self.state > 0


KV = LayerCache()
NO_CACHE = LayerCache(cached=False)

# Families whose make_cache() skips layers that take no cache: which layers take one
# (mlx-lm's own forward hands its caches out in this order).
_TAKES_CACHE = {
    "nemotron_h": lambda layer: layer.block_type in ("M", "*"),
    "granitemoehybrid": lambda layer: layer.layer_type in ("mamba", "attention"),
}


def layer_caches(model: nn.Module, family: str, num_layers: int) -> tuple[LayerCache, ...]:
    """Per layer, what it keeps (attention KV and its window, or recurrent state), from
    mlx-lm's caches: make_cache() when the family has one, else a KVCache per layer
    (mlx-lm's default)."""
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

    # a multimodal wrapper may leave its text model's make_cache unexposed (mistral3)
    make = getattr(model, "make_cache", None) or getattr(
        model.get("language_model"), "make_cache", None
    )
    if make is None:
        return (KV,) * num_layers
    try:
        caches = make()
    except Exception as e:  # a family's own code: whatever it raises, one line
        raise CheckpointError(f"mlx-lm's {family} model cannot make its caches: {e}") from None
    kinds: list[LayerCache] = []
    for cache in caches:
        if type(cache) is KVCache:
            kinds.append(KV)
        elif type(cache) is RotatingKVCache and not cache.keep:
            kinds.append(LayerCache(window=int(cache.max_size)))
        elif type(cache) is ChunkedKVCache:  # keys of the query's own chunk only
            kinds.append(LayerCache(chunk=int(cache.chunk_size)))
        elif isinstance(cache, ArraysCache):  # MambaCache is an ArraysCache of 2
            kinds.append(LayerCache(state=len(cache.cache)))
        else:
            kind = _cache_kind(cache)
            raise CheckpointError(
                f"{family} has {kind}, which this engine cannot serve yet (it serves "
                "attention layers, full or sliding-window, and recurrent state)"
            )
    takes = _TAKES_CACHE.get(family)
    if takes is not None and len(caches) < num_layers:
        layers = find_layers(model, family).layers
        if sum(map(takes, layers)) == len(kinds):
            given = iter(kinds)
            kinds = [next(given) if takes(layer) else NO_CACHE for layer in layers]
    if len(kinds) != num_layers:
        raise CheckpointError(
            f"mlx-lm's {family} model makes {len(caches)} caches for {num_layers} layers: "
            "this engine cannot tell which layer each belongs to"
        )
    return tuple(kinds)


def _cache_kind(cache: Any) -> str:
    """What a layer cache the engine cannot hold keeps, in words for the refusal."""
    from mlx_lm.models.cache import CacheList, KVCache

    if isinstance(cache, CacheList) and all(type(c) is KVCache for c in cache.caches):
        # DeepSeek V3.2 / GLM-5: the indexer's keys beside the latent KV, per layer
        return (
            "sparse attention (DSA: each layer keeps its indexer's keys in a second cache "
            "beside its KV)"
        )
    name = type(cache).__name__
    return _STATE_NAMES.get(name, f"layers with a {name}")


def layer_windows(model: nn.Module, family: str, num_layers: int) -> tuple[int | None, ...]:
    """Per layer, its attention window (None: full attention or no attention)."""
    return tuple(c.window for c in layer_caches(model, family, num_layers))


def wants_array_mask(owner: nn.Module) -> bool:
    """Whether the family's layers need the causal mask as an array, never the string
    "causal" (MLA's DeepSeek V3 and Gemma 2 apply it to scores themselves): their own
    forward asks mlx-lm's create_attention_mask for one (`return_array=True`)."""
    try:
        source = inspect.getsource(type(owner).__call__)
    except (OSError, TypeError):  # no source to read: an array is always safe
        return True
    return "return_array=True" in source


def check_layer_call(layer: nn.Module, family: str) -> None:
    """The engine calls each layer as `layer(hidden, mask, cache=cache)`, as most mlx-lm
    models do; a layer that needs more (position embeddings, a layer index) is refused."""
    params = list(inspect.signature(type(layer).__call__).parameters.values())[1:]
    names = [p.name for p in params]
    required = [
        p.name
        for p in params[2:]
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name != "cache"
    ]
    if len(params) < 2 or "cache" not in names or required:
        raise CheckpointError(
            f"mlx-lm's {family} layers are called as {type(layer).__name__}"
            f"({', '.join(names)}), not (x, mask, cache): this engine cannot run them yet"
        )
