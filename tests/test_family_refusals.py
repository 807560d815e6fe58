"""What the engine does not serve stops the start with one line, through the real CLI
(`wedlm generate --model DIR`): a model_type mlx-lm does not know, a family whose layers
keep recurrent state (linear attention, Mamba), and a checkpoint whose tensors disagree
with its config.json (missing, extra, misshapen), each named with its file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from tests.checkpoints import make_mlx_checkpoint

SMALL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
}
LINEAR = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}
# Recurrent families, as config.json only: they are refused before any weight is read.
RECURRENT = {
    "qwen3_next": {
        **SMALL,
        **LINEAR,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.5,
    },
    "nemotron_h": {
        **SMALL,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": "M*M-",
    },
    # the multimodal layout: the text model's sizes under text_config
    "qwen3_5": {"text_config": {**SMALL, **LINEAR, "model_type": "qwen3_5_text"}},
}


def wedlm_generate(model) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "wedlm_client.cli", "generate", "--model", str(model)]
    return subprocess.run(
        [*argv, "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def assert_refused(model, *parts: str) -> None:
    out = wedlm_generate(model)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    line = next((ln for ln in out.stderr.splitlines() if parts[0] in ln), None)
    assert line is not None, out.stderr
    for part in parts:
        assert part in line, (part, out.stderr)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return make_mlx_checkpoint(tmp_path_factory.mktemp("refusals") / "gpt_oss", "gpt_oss")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_model_type_mlx_lm_does_not_know(gpt_oss, tmp_path):
    d = _copy(gpt_oss, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_family"}))
    assert_refused(d, str(d / "config.json"), "unsupported model_type 'no_such_family'", "mlx-lm")


@pytest.mark.parametrize("family", list(RECURRENT))
def test_recurrent_families_are_refused_by_name(family, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, **RECURRENT[family]}))
    assert_refused(
        tmp_path,
        f"{family} has linear-attention, state-space or convolution layers (recurrent state)",
        "cannot serve yet",
        str(tmp_path / "config.json"),
    )


def _rewrite(d, change) -> None:
    path = d / "model.safetensors"
    tensors = dict(mx.load(str(path)))
    change(tensors)
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})


def test_weights_that_disagree_with_config_json(gpt_oss, tmp_path):
    sinks, q = "model.layers.1.self_attn.sinks", "model.layers.0.self_attn.q_proj.weight"

    d = _copy(gpt_oss, tmp_path / "missing")
    _rewrite(d, lambda t: t.pop(sinks))
    assert_refused(d, str(d), f"tensor {sinks} is missing", "shape (4,)")

    d = _copy(gpt_oss, tmp_path / "extra")
    _rewrite(d, lambda t: t.update({"model.layers.2.mlp.spare.weight": mx.zeros((2, 2))}))
    assert_refused(
        d, str(d / "model.safetensors"), "tensor model.layers.2.mlp.spare.weight is not part"
    )

    d = _copy(gpt_oss, tmp_path / "shape")
    _rewrite(d, lambda t: t.update({q: mx.zeros((32, 64))}))
    assert_refused(
        d, str(d / "model.safetensors"), f"tensor {q} has shape (32, 64)", "expects (64, 64)"
    )
