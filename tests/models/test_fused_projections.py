"""q/k/v and gate/up as one matmul each (common/fused_projections.py): the same outputs, the
same parameters, each product computed once per input, and off where it must be."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from common.fused_projections import ProjectionSlice
from common.kv_rows import KVRows
from common.model_parts import load_model_parts, run_layers
from common.window_mask import window_visibility
from tests.conftest import shared_model

HIDDEN = 64  # tests/support/checkpoints.py's hidden size
# family -> fused groups per layer (qwen3_moe's MLP is a sparse block: attention only)
GROUPS_PER_LAYER = {"llama": 2, "qwen2": 2, "qwen3": 2, "qwen3_moe": 1}


def _forward(parts, tokens: mx.array, windows: np.ndarray) -> tuple[np.ndarray, list]:
    kv = KVRows(len(parts.layers), tokens.shape[0])
    out = parts.head(run_layers(parts, parts.embed(tokens), kv, windows))
    mx.eval(out)
    return np.array(out), [np.array(layer.keys) for layer in kv.layers]


def _groups(parts) -> int:
    return sum(
        1
        for layer in parts.layers
        for _, m in layer.named_modules()
        for n in m
        if n.endswith("_up_proj") or n == "qkv_proj"
    )


@pytest.mark.parametrize("family", list(GROUPS_PER_LAYER))
def test_fused_layers_compute_what_the_layers_own_projections_compute(checkpoint_dir, family):
    """A WeDLM-shaped window (non-causal mask) through fused and unfused layers: the same
    logits and the same cached keys, bit for bit; the same parameter count."""
    path = checkpoint_dir(family, seed=7, num_hidden_layers=3)
    fused, own = load_model_parts(path), load_model_parts(path, fuse=False)
    assert _groups(fused) == GROUPS_PER_LAYER[family] * 3 and _groups(own) == 0
    assert fused.num_parameters() == own.num_parameters()
    attn = fused.layers[0].self_attn
    names = [name for name, _ in tree_flatten(attn.parameters())]
    assert isinstance(attn.q_proj, ProjectionSlice)
    assert "qkv_proj.weight" in names and not any(n.startswith("q_proj") for n in names)
    tokens = mx.array([[3, 9, 27, 81, 20], [5, 6, 7, 8, 9]])
    windows = np.stack([window_visibility(np.array([True, True, False, True, False]))] * 2)
    (a, ka), (b, kb) = _forward(fused, tokens, windows), _forward(own, tokens, windows)
    np.testing.assert_array_equal(a, b)
    for x, y in zip(ka, kb, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_quantized_checkpoint_fuses_exactly():
    """r2 (6-bit, group 64): the stacked rows' scales and biases are the layers' own."""
    path = shared_model("wedlm-smollm2-135m-r2")
    fused, own = load_model_parts(path), load_model_parts(path, fuse=False)
    qkv = fused.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, nn.QuantizedLinear) and (qkv.bits, qkv.group_size) == (6, 64)
    tokens = mx.array([[1, 9690, 198, 2683, 359, 253]])
    causal = np.tri(6, dtype=bool)[None]
    np.testing.assert_array_equal(
        _forward(fused, tokens, causal)[0], _forward(own, tokens, causal)[0]
    )


def test_each_product_is_computed_once_per_input_and_not_kept(checkpoint_dir):
    path = checkpoint_dir("llama", seed=8, num_hidden_layers=1)
    attn = load_model_parts(path).layers[0].self_attn
    own = load_model_parts(path, fuse=False).layers[0].self_attn
    shared, calls = attn.q_proj._shared, []
    linear = shared.linear
    shared.linear = lambda x: calls.append(x) or linear(x)
    x, y = (mx.random.normal((1, 3, HIDDEN)) for _ in range(2))
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert len(calls) == 1 and shared.input is None  # all three served: nothing kept
    for mine, theirs in ((q, own.q_proj(x)), (k, own.k_proj(x)), (v, own.v_proj(x))):
        np.testing.assert_array_equal(np.array(mine), np.array(theirs))
    # a projection called on another input gets that input's product, not a stale one
    np.testing.assert_array_equal(np.array(attn.k_proj(y)), np.array(own.k_proj(y)))
    assert len(calls) == 2


def test_the_switch_and_tensor_groups_keep_the_layers_own_projections(checkpoint_dir, monkeypatch):
    path = checkpoint_dir("qwen3", seed=9, num_hidden_layers=2)
    monkeypatch.setenv("WEDLM_FUSED_PROJECTIONS", "0")
    assert _groups(load_model_parts(path)) == 0
    monkeypatch.delenv("WEDLM_FUSED_PROJECTIONS")
    parts = load_model_parts(path)
    assert _groups(parts) == 4
    # mlx-lm's shard replaces the layers' linears with sharded ones: those are never fused
    from common.fused_projections import fuse_projections

    own = load_model_parts(path, fuse=False)
    attn = own.layers[0].self_attn
    attn.q_proj = nn.QuantizedLinear(HIDDEN, attn.q_proj.weight.shape[0])  # not k's and v's kind
    assert fuse_projections(own.layers[:1]) == 1  # gate/up only
