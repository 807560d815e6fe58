"""q and k through one rope call where q/k/v are fused (common/fused_attention.py): which
attentions take it, and that they compute exactly what mlx-lm's own code computes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from common import fused_attention
from common.kv_rows import KVRows
from common.model_parts import load_model_parts, run_layers
from common.window_mask import window_visibility


class CountingRope(nn.Module):
    """A layer's rope, counting its calls and the heads they rotate."""

    def __init__(self, rope: nn.Module, calls: list[int]) -> None:
        super().__init__()
        self.inner, self.calls = rope, calls

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        self.calls.append(x.shape[1])
        return self.inner(x, offset=offset)


def _decode(parts, windows: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Rows of different committed lengths (a per-row rope offset), then one window."""
    kv = KVRows(len(parts.layers), 2)
    prompt = mx.array([[3, 9, 27, 81, 20, 11], [5, 6, 7, 8, 9, 10]])
    mx.eval(run_layers(parts, parts.embed(prompt), kv, np.stack([np.tri(6, dtype=bool)] * 2)))
    kv.commit([6, 4])  # row 1 keeps 4 of its 6: the rows now start at different positions
    window = mx.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    out = parts.head(run_layers(parts, parts.embed(window), kv, windows))
    mx.eval(out)
    return np.array(out), [np.array(layer.keys) for layer in kv.layers]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_rope_call_computes_what_mlx_lms_two_compute(checkpoint_dir, family):
    path = checkpoint_dir(family, seed=11, num_hidden_layers=2)
    fused, own = load_model_parts(path), load_model_parts(path, fuse=False)
    calls: list[int] = []
    for layer in fused.layers:
        attn = layer.self_attn
        assert type(attn).__call__ is fused_attention._one_rope_call
        attn.rope = CountingRope(attn.rope, calls)
    heads = fused.layers[0].self_attn
    windows = np.stack([window_visibility(np.array([True, False, True, False, False]))] * 2)
    (a, ka), (b, kb) = _decode(fused, windows), _decode(own, windows)
    np.testing.assert_array_equal(a, b)
    for x, y in zip(ka, kb, strict=True):
        np.testing.assert_array_equal(x, y)
    # one call per layer and forward (prompt, window), over the queries' and keys' heads
    assert calls == [heads.n_heads + heads.n_kv_heads] * 4


def test_other_attentions_keep_their_own_call(checkpoint_dir, monkeypatch):
    # qwen3 norms q and k between projection and rope: its own code runs
    qwen3 = load_model_parts(checkpoint_dir("qwen3", seed=12, num_hidden_layers=1))
    assert type(qwen3.layers[0].self_attn).__call__ is not fused_attention._one_rope_call
    # unfused layers (the switch off, or a tensor group's) have no qkv product to slice
    monkeypatch.setenv("WEDLM_FUSED_PROJECTIONS", "0")
    llama = load_model_parts(checkpoint_dir("llama", seed=12, num_hidden_layers=1))
    assert type(llama.layers[0].self_attn).__call__ is not fused_attention._one_rope_call
    assert not fused_attention.adopt(llama.layers[0].self_attn)
