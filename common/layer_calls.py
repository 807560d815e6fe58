"""Layers that mlx-lm's own forward calls otherwise than `layer(x, mask, cache=cache)`,
made callable the way the engine calls every layer.

What mlx-lm says in a layer's signature is read from it: a layer whose second parameter is
not its mask (ministral3's `attn_scale`, which its attention computes itself from
`cache.offset` when not given) gets its mask by name. What only a family's forward loop
says is a small table: Gemma 4's layers return `(hidden, kv, offset)` for the KV-shared
layers after them; Llama 4's RoPE-free layers read their cache's offset as one int.
Families whose layers need inputs the engine does not carry from stage to stage (Gemma
4's per-layer input embeddings, its KV-shared layers) are refused here."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from common.errors import CheckpointError, WedlmError

# layer class module -> (why the engine cannot run it, or None) for a built layer
_REFUSE: dict[str, Callable[[Any], str | None]] = {
    "mlx_lm.models.gemma4_text": lambda layer: (
        "per-layer input embeddings (hidden_size_per_layer_input), which each stage "
        "would need beside the hidden states"
        if layer.hidden_size_per_layer_input
        else "KV-shared layers (num_kv_shared_layers): later layers attend over earlier "
        "layers' keys and values"
        if not layer.self_attn.has_kv
        else None
    ),
}
# layer class module -> the length of the tuple its layers return, hidden states first
_TUPLES = {"mlx_lm.models.gemma4_text": 3}


def returned_tuple(layer: nn.Module) -> int:
    """The length of the tuple mlx-lm's forward unpacks from this layer (0: an array)."""
    return _TUPLES.get(_module(layer), 0)


def _module(layer: nn.Module) -> str:
    """The module of the layer's mlx-lm class (an adapted class is its subclass)."""
    cls = type(layer)
    return cls.__mro__[1].__module__ if getattr(cls, "_engine_call", False) else cls.__module__


_ADAPTED: dict[type, type] = {}


class _IntOffset:
    """A layer's cache with its offset as a Python int: Llama 4's RoPE-free layers take
    `mx.arange(offset + 1, ...)` for their attention temperature, which mlx-lm computes
    for one offset only. Rows at different offsets get one int when every position is
    below the temperature's floor_scale (the temperature is 1 there, whatever the int)."""

    def __init__(self, cache: Any, floor_scale: int, width: int) -> None:
        self._cache = cache
        offset = cache.offset
        if isinstance(offset, mx.array) and offset.ndim:
            # the offsets were made from the host's lengths (KVRows.begin): reading them
            # back waits for nothing, where offset.max().item() would queue behind the
            # forward's kernels and sync the host once per such layer
            if int(np.asarray(offset).max()) + width > floor_scale:
                raise WedlmError(
                    f"llama4 cannot batch rows at different positions past {floor_scale} "
                    "(its attention temperature takes one offset)"
                )
            offset = 0
        self.offset = int(offset)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def _llama4_nope(self: nn.Module, x: Any, mask: Any, cache: Any, call: Callable) -> Any:
    attn = self.self_attn
    if cache is not None and not attn.use_rope and attn.attn_temperature_tuning:
        cache = _IntOffset(cache, int(attn.floor_scale), x.shape[1])
    return call(self, x, mask, cache)


# layer class module -> how its layer is called around mlx-lm's own call
_AROUND: dict[str, Callable] = {"mlx_lm.models.llama4": _llama4_nope}


def adapt_layers(layers: list[nn.Module], family: str) -> None:
    """Make each layer callable as `layer(x, mask, cache=cache)` returning the hidden
    states, in place (its class becomes a subclass: parameter names stay the same)."""
    for layer in layers:
        cls = type(layer)
        refuse = _REFUSE.get(cls.__module__)
        why = refuse(layer) if refuse is not None else None
        if why is not None:
            raise CheckpointError(f"{family} has {why}: this engine cannot serve it yet")
        adapted = _adapted(cls)
        if adapted is not cls:
            layer.__class__ = adapted


def _adapted(cls: type) -> type:
    if cls in _ADAPTED or getattr(cls, "_engine_call", False):
        return _ADAPTED.get(cls, cls)
    names = list(inspect.signature(cls.__call__).parameters)[1:]
    by_name = "mask" in names and names.index("mask") != 1
    first = cls.__module__ in _TUPLES
    around = _AROUND.get(cls.__module__)
    if not by_name and not first and around is None:
        _ADAPTED[cls] = cls
        return cls

    def call(self: nn.Module, x: Any, mask: Any, cache: Any) -> Any:
        if by_name:
            return cls.__call__(self, x, mask=mask, cache=cache)
        return cls.__call__(self, x, mask, cache)

    def __call__(self: nn.Module, x: Any, mask: Any = None, cache: Any = None) -> Any:
        out = around(self, x, mask, cache, call) if around else call(self, x, mask, cache)
        return out[0] if first else out

    _ADAPTED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_engine_call": True})
    return _ADAPTED[cls]
