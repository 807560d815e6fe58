"""The pieces of a DiffusionGemma model one process holds: a contiguous range of decoder
layers (each with its encoder-side layer scalar: the encoder and the decoder share every
weight but that one), and optionally the ends: the embedding (also the tied LM head), the
final norm and the self-conditioning block. Built from mlx-vlm's model modules, as
ModelParts is built from mlx-lm's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from common.checkpoint_weights import layer_of, load_tensors
from common.diffusion.grouped_experts import grouped_experts_class
from common.diffusion.mlx_vlm_modules import diffusion_gemma
from common.errors import CheckpointError
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.parts_weights import install_weights, quantize_parts

_DECODER = "model.decoder."
_ENCODER_SCALARS = "model.encoder.language_model.layers."
_ENDS = ("embed_tokens", "norm", "self_conditioning")


def build_model(config: ModelConfig) -> nn.Module:
    """mlx-vlm's whole DiffusionGemma model, text only (parameters stay lazy: only the
    modules a process keeps are ever materialized)."""
    module = diffusion_gemma()
    raw = {k: v for k, v in config.raw.items() if k != "vision_config"}
    try:
        return module.Model(module.ModelConfig.from_dict(raw))
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"{config.path / 'config.json'}: cannot build a DiffusionGemma model: {e}"
        ) from None


class SlotRoPE(nn.Module):
    """A layer's RoPE that also takes one offset per slot ([B, T]: a compacted forward's
    scattered positions) by folding the slots into the batch axis, so the model's own
    rotation (default or proportional partial) applies at each slot's position."""

    def __init__(self, rope: nn.Module) -> None:
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if not isinstance(offset, mx.array) or offset.ndim < 2:
            return self.rope(x, offset=offset)
        b, h, t, d = x.shape
        folded = x.transpose(0, 2, 1, 3).reshape(b * t, h, 1, d)
        out = self.rope(folded, offset=offset.reshape(-1))
        return out.reshape(b, t, h, d).transpose(0, 2, 1, 3)


class DiffusionParts(nn.Module):
    """Layers `layer_range` of a DiffusionGemma model, plus the ends when asked for."""

    def __init__(
        self, config: ModelConfig, full: nn.Module, layer_range: LayerRange | None, with_ends: bool
    ) -> None:
        super().__init__()
        text = full.config.text_config
        self.config = config
        self.layer_range = layer_range
        self.with_ends = with_ends
        indices = list(layer_range) if layer_range else []
        decoder = full.model.decoder
        self.layers = [decoder.layers[i] for i in indices]
        grouped = grouped_experts_class()
        for layer in self.layers:
            layer.self_attn.rope = SlotRoPE(layer.self_attn.rope)
            layer.experts = grouped(text)  # the same parameters, grouped by expert on CUDA
        self.encoder_scalars = [full.model.encoder.language_model.layers[i] for i in indices]
        self.sliding = tuple(text.layer_types[i] == "sliding_attention" for i in indices)
        self.sliding_window = int(text.sliding_window)
        self.embed_scale = text.hidden_size**0.5
        if with_ends:
            self.embed_tokens = decoder.embed_tokens
            self.norm = decoder.norm
            self.self_conditioning = decoder.self_conditioning
        self._softcap = diffusion_gemma().language.make_compiled_softcap(
            float(text.final_logit_softcapping)
        )

    # ---- names: ours <-> the checkpoint's ------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        head, _, rest = name.partition(".")
        if head in ("layers", "encoder_scalars"):
            idx, _, tail = rest.partition(".")
            layer = int(idx) + self.layer_range.start
            prefix = f"{_DECODER}layers." if head == "layers" else _ENCODER_SCALARS
            return f"{prefix}{layer}.{tail}"
        return _DECODER + name

    def local_name(self, key: str) -> str | None:
        layer = layer_of(key)
        if layer is not None:
            if self.layer_range is None or layer not in self.layer_range:
                return None
            j = layer - self.layer_range.start
            if key.startswith(_ENCODER_SCALARS):
                tail = key.split(".", 5)[5]
                return f"encoder_scalars.{j}.{tail}" if tail == "layer_scalar" else None
            return f"layers.{j}.{key.split('.', 4)[4]}"
        if self.with_ends and key.startswith(_DECODER):
            name = key[len(_DECODER) :]
            if name.split(".", 1)[0] in _ENDS:
                return name
        return None

    # ---- the coordinator's ends ------------------------------------------------------
    @property
    def prefers_logits_self_conditioning(self) -> bool:
        """A quantized embedding table conditions on logits (mlx-vlm's rule)."""
        return isinstance(self.embed_tokens, nn.QuantizedEmbedding)

    @property
    def compute_dtype(self) -> mx.Dtype:
        """The dtype hidden states and embeddings have (the norms' weights')."""
        return self.norm.weight.dtype

    def embed(self, tokens: mx.array) -> mx.array:
        """Encoder input: the scaled token embeddings (prompt and committed canvases)."""
        return self.embed_tokens(tokens) * self.embed_scale

    def embed_canvas(self, tokens: mx.array, conditioning: mx.array | None) -> mx.array:
        """Decoder input of a canvas: token embeddings through the self-conditioning block,
        conditioned on the previous step's predictions (None on a canvas's first step)."""
        decoder = diffusion_gemma().language.DecoderModel
        if conditioning is None:
            return decoder._embed_canvas(self, tokens)
        if self.prefers_logits_self_conditioning:
            return decoder._embed_canvas(self, tokens, self_conditioning_logits=conditioning)
        return decoder._embed_canvas(self, tokens, self_conditioning_embeddings=conditioning)

    def conditioning(self, processed_logits: mx.array) -> mx.array:
        """The reference's self-conditioning signal from full-vocabulary logits: the
        logits themselves for a quantized table, else softmax(logits) @ table, scaled."""
        decoder = diffusion_gemma().language.DecoderModel
        weight = None if self.prefers_logits_self_conditioning else self.embed_tokens.weight
        return decoder.diffusion_self_conditioning(self, processed_logits, weight)

    def head_logits(self, hidden: mx.array) -> mx.array:
        """Raw logits (before the softcap) of final hidden states."""
        return self.embed_tokens.as_linear(self.norm(hidden))

    def softcap(self, logits: mx.array) -> mx.array:
        """float32 tanh softcap, as the model applies it to every logit."""
        return self._softcap(logits)

    def head(self, hidden: mx.array) -> mx.array:
        return self.softcap(self.head_logits(hidden))

    def num_parameters(self) -> int:
        return sum(p.size for _, p in tree_flatten(self.parameters()))


def _quantize(parts: DiffusionParts, quant: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Quantize the modules the checkpoint stores quantized, with the per-module settings
    mlx-vlm writes into config.json (its DiffusionGemma predicate keeps attention, the
    router, the dense MLP and the embedding at 8 bits)."""

    def override(path: str) -> dict | None:
        name = parts.checkpoint_name(path)
        for key in (name, f"language_model.{name}"):
            if isinstance(quant.get(key), dict):
                return quant[key]
        return None

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return override(path) or True

    quantize_parts(parts, quant, predicate)


def load_diffusion_parts(
    config: ModelConfig, layer_range: LayerRange | None, with_ends: bool
) -> DiffusionParts:
    full = build_model(config)
    parts = DiffusionParts(config, full, layer_range, with_ends)
    keep = parts.local_name
    path = Path(config.path)

    def wanted(key: str) -> bool:
        # checkpoints in the Hugging Face layout store experts one by one: sanitize stacks
        # them, so every tensor of a kept layer is read
        layer = layer_of(key)
        if layer is not None:
            return layer_range is not None and layer in layer_range
        return keep(key) is not None

    raw = load_tensors(path, wanted)
    weights = {keep(k): v for k, v in full.sanitize(raw).items() if keep(k) is not None}
    del full
    if config.quantization:
        _quantize(parts, config.quantization, weights)
    install_weights(parts, weights, path)
    return parts
