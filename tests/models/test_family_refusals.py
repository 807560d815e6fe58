"""What the engine does not serve stops the start with one line, through the real CLI
(`wedlm generate --model DIR`): a model_type mlx-lm does not know, a decoding mode a
family with recurrent layers (linear attention, Mamba) cannot run, and a checkpoint whose
tensors disagree with its config.json (missing, extra, misshapen), each named with its
file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from tests.models.test_recurrent_families import SPECS
from tests.support.checkpoints import make_mlx_checkpoint


def wedlm_generate(model, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "wedlm_client.cli", "generate", "--model", str(model)]
    return subprocess.run(
        [*argv, "--prompt", "x", "--max-tokens", "4", *extra],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def assert_refused(model, *parts: str, extra: tuple[str, ...] = ()) -> None:
    out = wedlm_generate(model, extra)
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


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    return make_mlx_checkpoint(root / "qwen3_next", "qwen3_next", spec=SPECS["qwen3_next"])


@pytest.mark.parametrize("mode", ["wedlm", "speculative"])
def test_a_recurrent_family_is_served_and_refuses_modes_by_name(qwen3_next, mode):
    """A hybrid family (recurrent linear-attention layers) loads and generates with AR;
    a mode that writes rows and takes some back stops with one line naming both."""
    served = wedlm_generate(qwen3_next)
    assert served.returncode == 0 and "Traceback" not in served.stderr, served.stderr
    assert_refused(
        qwen3_next,
        f"mode {mode} is not served for qwen3_next",
        "recurrent layers",
        "use mode ar",
        extra=("--mode", mode),
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
