"""Tiny random DiffusionGemma checkpoints, made with mlx-vlm's own model classes (so tensor
names, the stacked-expert layout and the quantization settings are what mlx-vlm writes).
Sliding and full attention layers alternate, the sliding window is shorter than the
prompts, and the embedding (also the tied head) is scaled up so that confidences vary:
some denoising steps commit one position, others several."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from tests.support.checkpoints import _write_tokenizer

TEXT: dict[str, Any] = {
    "model_type": "diffusion_gemma_text",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_global_key_value_heads": 1,
    "head_dim": 32,
    "global_head_dim": 64,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_experts": 4,
    "top_k_experts": 2,
    "max_position_embeddings": 512,
    "final_logit_softcapping": 30.0,
}
CANVAS = 16
EMBED_STD = 1.0  # logits ~ N(0, hidden): peaked enough that confidences cross 0.9 at times


def _randomize(model: nn.Module, seed: int) -> None:
    """Seeded weights: matrices ~ N(0, 1/fan_in), norms and scalars near 1."""
    mx.random.seed(seed)

    def init(path: str, p: mx.array) -> mx.array:
        if "embed_tokens" in path:
            return mx.random.normal(p.shape) * EMBED_STD
        if p.ndim == 1 or "scalar" in path or "per_expert_scale" in path:
            return 1.0 + 0.1 * mx.random.normal(p.shape)
        return mx.random.normal(p.shape) / (p.shape[-1] ** 0.5)

    flat = tree_flatten(model.parameters())
    model.load_weights([(k, init(k, v)) for k, v in flat])
    mx.eval(model.parameters())


def make_diffusion_checkpoint(
    out_dir: Path, seed: int = 0, bits: int | None = None, **text_overrides: Any
) -> Path:
    """Write a tiny DiffusionGemma checkpoint into `out_dir` (float32, or `bits`-bit
    experts with 8-bit attention, router, dense MLP and embedding as mlx-vlm quantizes)."""
    from mlx_vlm.models.diffusion_gemma import Model, ModelConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = {**TEXT, **text_overrides}
    ids = _write_tokenizer(out_dir, text["vocab_size"])
    text.update(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None
    )
    config: dict[str, Any] = {
        "model_type": "diffusion_gemma",
        "text_config": text,
        "canvas_length": CANVAS,
        "vision_config": None,  # text only, as text-only quants write it
        "eos_token_id": ids["<|im_end|>"],
    }
    model = Model(ModelConfig.from_dict(config))
    _randomize(model, seed)
    if bits is not None:
        group = 32
        overrides: dict[str, Any] = {}
        predicate = model.quant_predicate

        def choose(path: str, module: nn.Module):
            rule = predicate(path, module)
            if rule is False or module.weight.shape[-1] % group:
                return False
            if isinstance(rule, dict):  # 8 bits where mlx-vlm keeps them: in groups of ours
                rule = {"group_size": group, "bits": rule["bits"]}
                overrides[path] = rule
            return rule

        nn.quantize(model, group_size=group, bits=bits, class_predicate=choose)
        config["quantization"] = {"group_size": group, "bits": bits, **overrides}
    else:
        model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"eos_token_id": ids["<|im_end|>"], "max_denoising_steps": 12}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir
