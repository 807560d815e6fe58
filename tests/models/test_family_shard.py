"""A tensor group's split is mlx-lm's own `Model.shard`, run on the layers one member holds
(a range that does not start at 0), wherever the family keeps its list: DeepSeek V3 at
model.layers, Kimi K2.5 at language_model.model.layers (its shard goes through
`self.language_model`). In a group of one the split layers compute what they did before;
a family mlx-lm has no shard for is named with what to use instead."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from common.kv_rows import KVRows
from common.layer_range import LayerRange
from common.model_config import load_model_config
from common.model_parts import load_model_parts, run_layers
from common.tensor_group.spec import check_tp_flag, shard_layers, shard_problem
from tests.support.checkpoints import _DEEPSEEK_V3, MLX_FAMILIES, make_mlx_checkpoint

SPECS = {
    "deepseek_v3": MLX_FAMILIES["deepseek_v3"],
    "kimi_k25": (
        "KimiK25ForConditionalGeneration",
        {"text_config": {"model_type": "deepseek_v3", **_DEEPSEEK_V3}},
        False,
    ),
}


def _forward(parts, hidden: mx.array) -> mx.array:
    """The layers on a fresh prompt of hidden states (causal)."""
    kv = KVRows(len(parts.layers), hidden.shape[0])
    t = hidden.shape[1]
    out = run_layers(parts, hidden, kv, np.tri(t, dtype=bool)[None])
    mx.eval(out)
    return out


@pytest.mark.parametrize("family", list(SPECS))
def test_mlx_lm_shard_splits_the_held_layers(family, tmp_path):
    path = make_mlx_checkpoint(tmp_path / family, family, seed=3, spec=SPECS[family])
    config = load_model_config(path)
    assert shard_problem(config, 2) is None
    parts = load_model_parts(path, LayerRange(1, 2), with_ends=False, config=config, fuse=False)
    hidden = mx.random.normal((1, 12, config.hidden_size), key=mx.random.key(0))
    before = _forward(parts, hidden)
    shard_layers(config, parts.layers, mx.distributed.init())  # a group of one
    kinds = {type(layer.self_attn.o_proj).__name__ for layer in parts.layers}
    assert kinds == {"ShardedToAllLinear"}, kinds  # mlx-lm's shard_linear ran on each
    assert mx.allclose(_forward(parts, hidden), before, atol=1e-5).item()


def test_a_family_without_shard(tmp_path):
    path = make_mlx_checkpoint(tmp_path / "gemma3_text", "gemma3_text", seed=3)
    config = load_model_config(path)
    why = "gemma3_text cannot be split across a tensor group: mlx-lm has no shard for it"
    assert shard_problem(config, 2) == f"{why}; use stages"
    with pytest.raises(Exception, match=f"^--tp 2: {why}; use stages$"):
        check_tp_flag(config, 2)
    check_tp_flag(config, "auto")  # auto plans stages instead, and says why
    check_tp_flag(config, 1)
    diffusion = dataclasses.replace(config, model_type="diffusion_gemma")
    assert "diffusion model" in shard_problem(diffusion, 2)
