"""Random checkpoints of real models' shapes, the one writer the scripts in benchmarks/dev/
use (the tests' tiny parity checkpoints are tests/support/checkpoints.py's): any mlx-lm
family, in the layout mlx-lm's `convert` writes (its parameter names, config.json with
`quantization`, sharded safetensors and their index), and a word-level tokenizer with one
token per model id, so every id a random model emits decodes.

The model is built from mlx-lm's own Model and ModelArgs (nothing re-implemented); its
parameters are replaced lazily by bf16 noise (norm weights 1, biases 0) and, with `--bits`,
quantized by mlx-lm's own quantize_model in the given mode, as mlx-community ships these
models (gpt-oss: mxfp4 experts). mlx-lm's save_model evaluates one shard at a time, so at
most one shard's tensors are alive; on a GPU the time is the disk's.

  python -m devtools.random_checkpoints --shape qwen3-8b --layers 12 --out /tmp/rq8
  python -m devtools.random_checkpoints --shape gpt-oss-20b --bits 4 --out /tmp/goss
  python -m devtools.random_checkpoints --shape deepseek-v3 --layers 4 --bits 4 --out /tmp/dsv3
Smoke test (CPU): --shrink makes every width small (the same family and layer pattern).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

# Qwen3-8B and -32B (the TP and serving benchmarks' shapes), under tp_shapes' key names.
QWEN3_VOCAB = 151936
QWEN3_HEAD_DIM = 128
QWEN3_SHAPES: dict[str, dict[str, int]] = {
    "qwen3-8b": {"hidden": 4096, "layers": 36, "heads": 32, "kv_heads": 8, "mlp": 12288},
    "qwen3-32b": {"hidden": 5120, "layers": 64, "heads": 64, "kv_heads": 8, "mlp": 25600},
}
# Qwen's special tokens at their ids (a Qwen3 checkpoint's tokenizer); other shapes put
# theirs at the end of the vocabulary.
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
SPECIALS = tuple(QWEN_SPECIALS)

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


def qwen3_shape(name: str) -> dict[str, int]:
    """One of QWEN3_SHAPES under write_random_qwen3's key names."""
    s = QWEN3_SHAPES[name]
    return dict(layers=s["layers"], hidden=s["hidden"], intermediate=s["mlp"], heads=s["heads"],
                kv_heads=s["kv_heads"], head_dim=QWEN3_HEAD_DIM, vocab=QWEN3_VOCAB)  # fmt: skip


QWEN3_8B = qwen3_shape("qwen3-8b")


def qwen3_config(s: dict[str, int]) -> dict[str, Any]:
    """config.json of a Qwen3 of shape `s` (qwen3_shape's keys), bf16."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": QWEN_SPECIALS["<|endoftext|>"],
        "eos_token_id": QWEN_SPECIALS["<|im_end|>"],
    }


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


def word_tokenizer(
    out: Path, vocab: int, specials: dict[str, int] | None = None, max_length: int = 131072
) -> dict[str, int]:
    """A word-level tokenizer with one token per model id (w0, w1, ...), so every id a random
    model emits decodes; the special tokens at `specials`' ids, else at the end. Their ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    ids = specials or {t: vocab - len(SPECIALS) + i for i, t in enumerate(SPECIALS)}
    by_id = {i: t for t, i in ids.items()}
    table = {by_id.get(i, f"w{i}"): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(table, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(ids))
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "w0",
        "model_max_length": max_length,
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
        else:  # drawn in bf16: no float32 copy to cast
            value = mx.random.normal(p.shape, dtype=mx.bfloat16, scale=0.02, key=sub)
        new.append((name, value))
    model.update(tree_unflatten(new))


def write_random_checkpoint(
    out: Path,
    config: dict[str, Any],
    bits: int | None = None,
    mode: str = "affine",
    specials: dict[str, int] | None = None,
    max_length: int = 131072,
) -> Path:
    """The one writer: mlx-lm's Model of `config`, bf16 noise, quantized with `bits`, saved
    by mlx-lm at `out` (reused when a complete one of the same config is there)."""
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    config = json.loads(json.dumps(config))  # a copy: the ids and quantization go in below
    want = {"config": json.loads(json.dumps(config)), "bits": bits, "mode": mode}
    done = out / ".complete"
    if done.exists() and json.loads(done.read_text()) == want:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors"):
        old.unlink()
    vocab = config.get("text_config", config)["vocab_size"]
    ids = word_tokenizer(out, vocab, specials, max_length)
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


def write_random_qwen3(out: Path, layers: int, hidden: int, shape: str = "qwen3-8b") -> Path:
    """Random bf16 weights of `shape` with `layers` layers. A hidden size other than the
    shape's shrinks it for a smoke test (MLP 3x hidden, heads of 128, a quarter as many KV
    heads). Qwen's special tokens at their ids."""
    base = qwen3_shape(shape)
    s = dict(base, layers=layers, hidden=hidden)
    if hidden != base["hidden"]:
        s.update(intermediate=3 * hidden, heads=max(1, hidden // 128))
        s["kv_heads"] = max(1, s["heads"] // 4)
    return write_random_checkpoint(out, qwen3_config(s), specials=QWEN_SPECIALS, max_length=40960)


def write_random_family(
    out: Path,
    shape: str,
    layers: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    shrink: bool = False,
) -> Path:
    """SHAPES[shape] at `out`, cut to `layers`, quantized with `bits`, --shrink's widths."""
    return write_random_checkpoint(out, shape_config(shape, layers, shrink), bits, mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted([*SHAPES, *QWEN3_SHAPES]), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, help="fewer layers than the real model")
    ap.add_argument("--bits", type=int, help="quantize (mlx-lm's quantize_model)")
    ap.add_argument("--mode", default="affine", choices=["affine", "mxfp4", "nvfp4", "mxfp8"])
    ap.add_argument("--shrink", action="store_true", help="small widths: a CPU smoke test")
    args = ap.parse_args()
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be at least 1")
    if args.shape in QWEN3_SHAPES:
        if args.bits is not None or args.shrink:
            ap.error(
                f"--shape {args.shape}: bf16 at its own widths (--bits, --shrink: another shape)"
            )
        layers = args.layers or QWEN3_SHAPES[args.shape]["layers"]
        hidden = QWEN3_SHAPES[args.shape]["hidden"]
        path = write_random_qwen3(args.out, layers, hidden, shape=args.shape)
    else:
        path = write_random_family(
            args.out, args.shape, args.layers, args.bits, args.mode, args.shrink
        )
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(json.dumps({"path": str(path), "shape": args.shape, "bytes": size}))


if __name__ == "__main__":
    main()
