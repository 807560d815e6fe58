"""What the engine needs to know of an mlx-lm model family, read from mlx-lm itself.

A checkpoint's `model_type` is resolved through mlx-lm's own registry (`_get_classes`:
its MODEL_REMAPPING and architecture remapping), so a family is served when mlx-lm has
it. From the built model object this module finds the layer list (wherever the family
keeps it) and what each layer's attention needs, from mlx-lm's `make_cache()`: a
`KVCache` is full attention, a `RotatingKVCache(max_size=W)` a sliding window of W
positions; any other cache (ArraysCache, MambaCache, ...) is recurrent state, which the
engine's per-row KV cache cannot hold yet."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.nn as nn

from common.errors import CheckpointError

# Cache classes that are not attention KV, named in the refusal by what they hold.
_STATE_NAMES = {
    "ArraysCache": "linear-attention, state-space or convolution layers (recurrent state)",
    "MambaCache": "Mamba (state-space) layers (recurrent state)",
    "CacheList": "layers with several caches each (hybrid attention and recurrent state)",
    "ChunkedKVCache": "chunked-attention layers",
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


def layer_windows(model: nn.Module, family: str, num_layers: int) -> tuple[int | None, ...]:
    """Per layer, its attention window (None: full attention), from mlx-lm's caches:
    make_cache() when the family has one, else a KVCache per layer (mlx-lm's default)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    make = getattr(model, "make_cache", None)
    if make is None:
        return (None,) * num_layers
    try:
        caches = make()
    except Exception as e:  # a family's own code: whatever it raises, one line
        raise CheckpointError(f"mlx-lm's {family} model cannot make its caches: {e}") from None
    windows: list[int | None] = []
    for cache in caches:
        if type(cache) is KVCache:
            windows.append(None)
        elif type(cache) is RotatingKVCache and not cache.keep:
            windows.append(int(cache.max_size))
        else:
            kind = _STATE_NAMES.get(type(cache).__name__, f"layers with a {type(cache).__name__}")
            raise CheckpointError(
                f"{family} has {kind}, which this engine cannot serve yet "
                "(it serves attention layers: full or sliding-window KV)"
            )
    if len(caches) != num_layers:
        raise CheckpointError(
            f"mlx-lm's {family} model makes {len(caches)} caches for {num_layers} layers: "
            "this engine cannot tell which layer each belongs to"
        )
    return tuple(windows)


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
