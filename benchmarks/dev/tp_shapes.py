"""The Qwen3-8B and -32B layer shapes benchmarks/dev/tp_gpu.py writes and sizes, and a
small random qwen3's arguments (its CPU dry runs and tests)."""

from __future__ import annotations

from typing import Any

from devtools.random_checkpoints import QWEN3_HEAD_DIM, QWEN3_SHAPES, QWEN3_VOCAB

VOCAB, SHAPES, HEAD_DIM = QWEN3_VOCAB, QWEN3_SHAPES, QWEN3_HEAD_DIM


def small_qwen3_args(layers: int, hidden: int) -> dict[str, Any]:
    """A small qwen3 whose heads (64 wide) and KV heads divide by 2."""
    heads = hidden // 64
    # fmt: off
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
                intermediate_size=3 * hidden, num_attention_heads=heads,
                num_key_value_heads=max(2, heads // 4), head_dim=64, rms_norm_eps=1e-6,
                vocab_size=1024, max_position_embeddings=4096, rope_theta=1e6,
                tie_word_embeddings=False)
    # fmt: on


def layer_params(shape: dict[str, int]) -> int:
    h, q, kv = shape["hidden"], shape["heads"] * HEAD_DIM, shape["kv_heads"] * HEAD_DIM
    return 2 * h * q + 2 * h * kv + 3 * h * shape["mlp"]
