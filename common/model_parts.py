"""The pieces of a model one process holds: a contiguous layer range, optionally the
embedding, the final norm and the LM head. Built from mlx-lm's own model modules."""

from __future__ import annotations

import importlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from common import fused_projections, layer_calls, model_families, small_query_attention
from common.checkpoint_weights import load_tensors, split_layer_key
from common.errors import CheckpointError
from common.kv_rows import KVRows
from common.layer_range import LayerRange
from common.model_config import ModelConfig, load_model_config
from common.model_ends import ModelEnds
from common.parts_weights import checkpoint_quantization, install_weights, quantize_as_stored
from common.recurrent_rows import run_state_layer
from common.weights_match import check_weights


class ModelParts(nn.Module):
    """Layers `layer_range` of a model, plus the ends (embedding, norm, head) when asked for.
    `caches[i]`: what layer i keeps (model_families.LayerCache, from mlx-lm's caches);
    `windows[i]`: its attention window (None: full attention)."""

    def __init__(
        self,
        config: ModelConfig,
        full: nn.Module,
        layer_range: LayerRange | None,
        with_ends: bool,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_range = layer_range
        self.with_ends = with_ends
        family = config.family
        try:
            found = model_families.find_layers(full, family)
            # called as (x, mask, cache=); a layer the stages cannot feed is refused first
            layer_calls.adapt_layers(found.layers, family)
            # what each layer keeps: attention KV (its window) or recurrent state
            all_caches = model_families.layer_caches(full, family, len(found.layers))
        except CheckpointError as e:
            raise CheckpointError(f"{config.path / 'config.json'}: {e}") from None
        if split_layer_key(f"{found.path}.0.w") is None:
            raise CheckpointError(
                f"{config.path / 'config.json'}: mlx-lm's {family} keeps its layers at "
                f"{found.path}, which this engine cannot split into layer ranges yet "
                "(it knows model.layers.N, language_model.model.layers.N and backbone.layers.N)"
            )
        self.layers_path = found.path  # the layers' parameter path in mlx-lm's model
        self.array_mask = model_families.wants_array_mask(found.owner)
        blocks = found.layers
        self.layers = [blocks[i] for i in layer_range] if layer_range else []
        for layer in self.layers:
            model_families.check_layer_call(layer, family)
        caches = tuple(all_caches[i] for i in layer_range) if layer_range else ()
        object.__setattr__(self, "caches", caches)  # plain attributes, not children
        object.__setattr__(self, "windows", tuple(c.window for c in caches))
        # any layer of the model (not only these) attends through a sliding window (or in
        # chunks: a mask that counts positions too), or keeps recurrent state: what the
        # engine's decoding modes ask of the whole model
        positional = any(c.window is not None or c.chunk is not None for c in all_caches)
        object.__setattr__(self, "sliding", positional)
        object.__setattr__(self, "recurrent", any(c.recurrent for c in all_caches))
        if with_ends:
            self.ends = ModelEnds(full, found)

    @property
    def embed_tokens(self) -> nn.Module:
        """The token embedding module (its weight's dtype is the model's)."""
        module = self.ends.embed_module() if "ends" in self else None
        if module is None:
            raise AttributeError("embed_tokens")
        return module

    def checkpoint_name(self, name: str) -> str:
        """Map our parameter name to the checkpoint's (`layers.0.x` → `model.layers.a.x`)."""
        if name.startswith("layers."):
            idx, rest = name[len("layers.") :].split(".", 1)
            return f"{self.layers_path}.{int(idx) + self.layer_range.start}.{rest}"
        if name.startswith("ends.model."):
            return name[len("ends.model.") :]
        return name

    def local_name(self, key: str) -> str | None:
        split = split_layer_key(key)
        if split is not None:
            layer, rest = split
            if self.layer_range is None or layer not in self.layer_range:
                return None
            return f"layers.{layer - self.layer_range.start}.{rest}"
        if not self.with_ends:
            return None
        return f"ends.model.{key}"

    def embed(self, tokens: mx.array) -> mx.array:
        return self.ends.embed(tokens)

    def head(self, hidden: mx.array) -> mx.array:
        return self.ends.head(hidden)

    def num_parameters(self) -> int:
        total = 0
        for _, p in tree_flatten(self.parameters()):
            total += p.size
        return total


def load_model_parts(
    path: str | Path,
    layer_range: LayerRange | None = None,
    with_ends: bool = True,
    config: ModelConfig | None = None,
    with_layers: bool = True,
    fuse: bool = True,
) -> ModelParts:
    """Load layers `layer_range` (all of them when None) and optionally the ends
    (embedding, final norm, head). `with_layers=False` loads only the ends, as the
    coordinator of a cluster holds them. `fuse` makes q/k/v and gate/up one matmul each
    (common/fused_projections.py); a tensor group shards the layers' own first."""
    config = config or load_model_config(path)
    if not with_layers:
        layer_range = None
    elif layer_range is None:
        layer_range = LayerRange.full(config.num_layers)
    if layer_range is not None and layer_range.end >= config.num_layers:
        raise CheckpointError(
            f"layer range {layer_range} is past the model's {config.num_layers} layers "
            f"(0-{config.num_layers - 1})"
        )
    if config.diffusion:
        from common.diffusion.parts import load_diffusion_parts

        return load_diffusion_parts(config, layer_range, with_ends)
    try:
        arch = importlib.import_module(f"mlx_lm.models.{config.family}")
        small_query_attention.install(arch)  # a forward of 2-32 rows skips cuDNN on CUDA
        # Building the whole mlx-lm model only creates lazy parameters; ModelParts keeps
        # the modules it needs and the rest is never materialized.
        full = arch.Model(arch.ModelArgs.from_dict(config.mlx_args()))
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
        raise CheckpointError(
            f"{config.path / 'config.json'}: cannot build a {config.family} model: {e}"
        ) from None
    parts = ModelParts(config, full, layer_range, with_ends)
    keep = parts.local_name
    raw = load_tensors(config.path, lambda k: keep(k) is not None)
    # mlx-lm's sanitize works on checkpoint names (stacks MoE experts, drops tied heads).
    sanitize = getattr(full, "sanitize", None)  # as mlx-lm's load: not every family has one
    raw = sanitize(raw) if sanitize is not None else raw
    weights = {keep(k): v for k, v in raw.items() if keep(k) is not None}
    del full
    if quant := checkpoint_quantization(config.raw, config.path / "config.json"):
        quantize_as_stored(parts, quant, weights, parts.checkpoint_name)
    check_weights(parts, weights, config.path, parts.checkpoint_name)
    install_weights(parts, weights, config.path)
    if with_ends:
        parts.ends.probe(config.family, config.hidden_size)
    del raw, weights  # the layers hold the only references: fusing frees as it goes
    if fuse and fused_projections.enabled():
        fused_projections.fuse_projections(parts.layers)
    return parts


LAUNCH_EVERY = 6  # layers per launched chunk of a forward's graph (0: one launch at the end)


def run_layers(
    parts: ModelParts,
    hidden: mx.array,
    kv: KVRows,
    windows: np.ndarray,
    widths: np.ndarray | None = None,
) -> mx.array:
    """Run `hidden` [rows, T, H] through this process's layers at the rows' current lengths
    (an mlx-lm family's layers; a diffusion model's run in common/diffusion/layers.py).
    A sliding-window layer gets the mask of its own window, built once per forward; a
    recurrent layer runs on each row's real slots only (`widths`; None: all T)."""
    mask = kv.begin(windows, widths)
    if isinstance(mask, str) and getattr(parts, "array_mask", False):
        mask = kv.sliding_mask(mask, None)  # "causal" as an array, for layers that need one
    caches = getattr(parts, "caches", None) or tuple(
        model_families.LayerCache(window=w) for w in getattr(parts, "windows", ())
    )  # a stand-in may name its windows only
    masks: dict[tuple[int | None, int | None], mx.array | str | None] = {(None, None): mask}
    for i, (layer, cache) in enumerate(zip(parts.layers, kv.layers, strict=True), 1):
        kind = caches[i - 1] if caches else model_families.KV
        if kind.recurrent:
            hidden = run_state_layer(layer, hidden, cache, kv.state_groups)
        elif not kind.cached:  # no cache and no attention (nemotron_h's MLP layers)
            hidden = layer(hidden, None, cache=None)
        else:
            key = (kind.window, kind.chunk)
            if key not in masks:
                masks[key] = kv.sliding_mask(mask, kind.window, kind.chunk)
            hidden = layer(hidden, masks[key], cache=cache)
        if LAUNCH_EVERY and i % LAUNCH_EVERY == 0 and i < len(parts.layers):
            # Start the device on the layers built so far: the host builds the rest of
            # the graph while they run, instead of the device waiting for all of it.
            mx.async_eval(hidden)
    return hidden
