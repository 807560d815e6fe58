"""A random checkpoint of a real model's shape, for any mlx-lm family, in the layout
mlx-lm's `convert` writes (its parameter names, config.json with `quantization`, sharded
safetensors and their index) and a word-level tokenizer with one token per model id, so
every id a random model emits decodes.

The model is built from mlx-lm's own Model and ModelArgs (nothing re-implemented); its
parameters are replaced lazily by bf16 noise (norm weights 1, biases 0) and, with
`--bits`, quantized by mlx-lm's own quantize_model in the given mode, as mlx-community
ships these models (gpt-oss: mxfp4 experts). mlx-lm's save_model evaluates one shard at a
time, so at most one shard's tensors are alive.

  python -m benchmarks.dev.random_family --shape gpt-oss-20b --bits 4 --out /tmp/goss
  python -m benchmarks.dev.random_family --shape deepseek-v3 --layers 4 --bits 4 --out /tmp/dsv3
Smoke test (CPU): --shrink makes every width small (the same family and layer pattern).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

# Real shapes (from the models' config.json on the Hub), minus tokenizer and rope details
# that do not change the cost of a step.
SHAPES: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0,
        "vocab_size": 201088,
        "tie_word_embeddings": False,
    },
    # DeepSeek V3 / Kimi K2: MLA attention, dense first layers, 256 routed experts
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
    },
    # Qwen3.5-35B-A3B: three gated-DeltaNet (linear attention) layers to one full one
    "qwen3.5-35b-a3b": {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "full_attention_interval": 4,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            "rms_norm_eps": 1e-6,
            "vocab_size": 248320,
            "tie_word_embeddings": False,
            "max_position_embeddings": 262144,
        },
    },
}

# widths that --shrink sets (a CPU smoke test of the same family and layer pattern)
SHRINK = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "vocab_size": 1024,
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def shape_config(name: str, layers: int | None, shrink: bool) -> dict[str, Any]:
    """SHAPES[name], with `layers` layers (the layer pattern cut to fit) and --shrink."""
    config = json.loads(json.dumps(SHAPES[name]))
    text = config.get("text_config", config)
    if layers is not None:
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
        if "first_k_dense_replace" in text:  # keep MoE layers in a cut DeepSeek
            text["first_k_dense_replace"] = min(text["first_k_dense_replace"], max(layers // 4, 1))
    if shrink:
        text.update({k: v for k, v in SHRINK.items() if k in text})
    if "text_config" in config:
        config["vocab_size"] = text["vocab_size"]
    config["torch_dtype"] = "bfloat16"
    return config


def _tokenizer_files(out: Path, vocab: int) -> dict[str, int]:
    """A word-level tokenizer: one token per id (w0, w1, ...), the specials at the end."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    ids = {t: vocab - len(SPECIALS) + i for i, t in enumerate(SPECIALS)}
    by_id = {i: t for t, i in ids.items()}
    table = {by_id.get(i, f"w{i}"): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(table, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "w0",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return ids


def _noise(model) -> None:
    """Every parameter replaced, lazily, by bf16 noise (norm weights 1, biases 0)."""
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(0)
    new = []
    for name, p in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        if p.ndim == 1 and ("norm" in name or name.endswith("weight")):
            value = mx.ones(p.shape, mx.bfloat16)
        elif p.ndim == 1:
            value = mx.zeros(p.shape, mx.bfloat16)
        else:
            value = mx.random.normal(p.shape, dtype=mx.bfloat16, scale=0.02, key=sub)
        new.append((name, value))
    model.update(tree_unflatten(new))


def write_random_family(
    out: Path,
    shape: str,
    layers: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    shrink: bool = False,
) -> Path:
    """The checkpoint at `out` (reused when a complete one of the same config is there)."""
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    config = shape_config(shape, layers, shrink)
    want = {"config": config, "bits": bits, "mode": mode}
    done = out / ".complete"
    if done.exists() and json.loads(done.read_text()) == want:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors"):
        old.unlink()
    vocab = config.get("text_config", config)["vocab_size"]
    ids = _tokenizer_files(out, vocab)
    config.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _noise(model)
    if bits is not None:
        model, config = quantize_model(model, config, None, bits, mode=mode)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    done.write_text(json.dumps(want))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, help="fewer layers than the real model")
    ap.add_argument("--bits", type=int, help="quantize (mlx-lm's quantize_model)")
    ap.add_argument("--mode", default="affine", choices=["affine", "mxfp4", "nvfp4", "mxfp8"])
    ap.add_argument("--shrink", action="store_true", help="small widths: a CPU smoke test")
    args = ap.parse_args()
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be at least 1")
    path = write_random_family(args.out, args.shape, args.layers, args.bits, args.mode, args.shrink)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(json.dumps({"path": str(path), "shape": args.shape, "bytes": size}))


if __name__ == "__main__":
    main()
