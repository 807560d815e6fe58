"""A random bf16 checkpoint of Qwen3-8B or Qwen3-32B shape, in the Hugging Face layout that
mlx-lm, our coordinator and our workers load: config.json, sharded safetensors with their
index, and a word-level tokenizer with one token per model id (w0, w1, …, and Qwen's
special tokens at their ids), so every id a random model emits decodes.

The weights are drawn in bf16 by mx.random on the default device, a few layers per shard,
so that at most one shard's tensors are alive at a time; on a GPU the time is the disk's."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from benchmarks.dev.tp_shapes import HEAD_DIM, SHAPES, VOCAB


def qwen3_shape(name: str) -> dict[str, int]:
    """One of tp_shapes.SHAPES under this writer's key names."""
    s = SHAPES[name]
    return dict(layers=s["layers"], hidden=s["hidden"], intermediate=s["mlp"], heads=s["heads"],
                kv_heads=s["kv_heads"], head_dim=HEAD_DIM, vocab=VOCAB)  # fmt: skip


QWEN3_8B = qwen3_shape("qwen3-8b")
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def _tokenizer_files(out: Path, vocab: int) -> None:
    """A word-level tokenizer with one token per model id (w0, w1, …, and Qwen's special
    tokens at their ids), so every id a random model emits decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    by_id = {i: t for t, i in SPECIALS.items()}
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
        "model_max_length": 40960,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _config(s: dict[str, int]) -> dict:
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
        "bos_token_id": SPECIALS["<|endoftext|>"],
        "eos_token_id": SPECIALS["<|im_end|>"],
    }


def write_random_qwen3(
    out: Path, layers: int, hidden: int, layers_per_shard: int = 4, shape: str = "qwen3-8b"
) -> Path:
    """Random bf16 weights of `shape` with `layers` layers, written shard by shard. A hidden
    size other than the shape's shrinks it for a smoke test (MLP 3x hidden, heads of 128,
    a quarter as many KV heads). Reused when a complete one is already there."""
    base = qwen3_shape(shape)
    s = dict(base, layers=layers, hidden=hidden)
    if hidden != base["hidden"]:
        s.update(intermediate=3 * hidden, heads=max(1, hidden // 128))
        s["kv_heads"] = max(1, s["heads"] // 4)
    raw = _config(s)
    done = out / ".complete"
    if done.exists() and json.loads(done.read_text()) == raw:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model-*.safetensors"):
        old.unlink()
    h, hd, v, inter = s["hidden"], s["head_dim"], s["vocab"], s["intermediate"]
    key = mx.random.key(0)

    def rand(shape_: tuple[int, ...]) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)  # drawn in bf16: no float32 copy to cast
        return mx.random.normal(shape_, dtype=mx.bfloat16, scale=0.02, key=sub)

    def ones(n: int) -> mx.array:
        return mx.ones((n,), mx.bfloat16)

    def layer(i: int) -> dict[str, mx.array]:
        p = f"model.layers.{i}."
        return {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand((s["heads"] * hd, h)),
            p + "self_attn.k_proj.weight": rand((s["kv_heads"] * hd, h)),
            p + "self_attn.v_proj.weight": rand((s["kv_heads"] * hd, h)),
            p + "self_attn.o_proj.weight": rand((h, s["heads"] * hd)),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": rand((inter, h)),
            p + "mlp.up_proj.weight": rand((inter, h)),
            p + "mlp.down_proj.weight": rand((h, inter)),
        }

    groups: list = [lambda: {"model.embed_tokens.weight": rand((v, h))}]
    for first in range(0, layers, layers_per_shard):
        ids = range(first, min(first + layers_per_shard, layers))
        groups.append(lambda ids=ids: {k: t for i in ids for k, t in layer(i).items()})
    groups.append(lambda: {"model.norm.weight": ones(h), "lm_head.weight": rand((v, h))})
    weight_map, total = {}, 0
    for n, make in enumerate(groups):
        tensors = make()
        mx.eval(tensors)
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        mx.save_safetensors(str(out / name), tensors, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
        del tensors
        mx.clear_cache()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    gen = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    _tokenizer_files(out, s["vocab"])
    done.write_text(json.dumps(raw))
    return out
