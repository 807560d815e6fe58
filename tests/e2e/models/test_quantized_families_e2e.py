"""Quantized checkpoints through 2 stages: a real coordinator (the first layers, embedding
and head) and a real worker (the rest) on 127.0.0.1, requests at once; every request's
greedy tokens equal mlx-lm's own `generate_step` on the same quantized files. A worker
that fetches its layers gets the checkpoint's own quantized tensors (openai's MXFP4
`_blocks` under a Hugging Face `quantization_config` included) and serves them."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from common.checkpoint_weights import layer_file_name
from tests.e2e.models.test_mlx_families_e2e import expected, served_through
from tests.support.checkpoints import make_mlx_checkpoint
from tests.support.cluster_harness import cluster_name, start_fetching_worker, start_worker
from tests.support.quantized_checkpoints import openai_gpt_oss_layout, quantize_checkpoint

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-e2e")
    gpt_oss = make_mlx_checkpoint(root / "gpt_oss", "gpt_oss", seed=5)
    mxfp4 = quantize_checkpoint(gpt_oss, root / "gpt_oss-mxfp4", "mxfp4")
    deepseek = make_mlx_checkpoint(root / "deepseek_v3", "deepseek_v3", seed=5)
    return {
        "gpt_oss-mxfp4": mxfp4,
        "gpt_oss-openai": openai_gpt_oss_layout(gpt_oss, mxfp4, root / "gpt_oss-openai"),
        "deepseek_v3-mixed_3_6": quantize_checkpoint(deepseek, root / "ds-mixed", "mixed_3_6"),
    }


@pytest.mark.parametrize("name", ["gpt_oss-mxfp4", "deepseek_v3-mixed_3_6"])
def test_two_stages_match_mlx_lm(models, name):
    path = models[name]
    cluster = cluster_name()
    worker, address = start_worker(path, cluster, "--no-bonjour", "--layers", "2-3")
    assert served_through(path, cluster, worker, address, "0-1") == expected(path)


def test_a_worker_fetches_openai_mxfp4_layers(models, tmp_path):
    path = models["gpt_oss-openai"]
    cluster = cluster_name()
    worker, address = start_fetching_worker(cluster, tmp_path / "cache")
    assert served_through(path, cluster, worker, address, "0-1") == expected(path)
    # the worker loaded what it fetched: layers 2-3 as stored (uint8 blocks), and the
    # config whose quantization_config says how to quantize them
    fetched = {f.name: f for f in (tmp_path / "cache").rglob("model-layer-*.safetensors")}
    assert sorted(fetched) == [layer_file_name(2), layer_file_name(3)]
    tensors = mx.load(str(fetched[layer_file_name(2)]))
    blocks = tensors["model.layers.2.mlp.experts.gate_up_proj_blocks"]
    assert blocks.dtype == mx.uint8
    (config,) = (tmp_path / "cache").rglob("config.json")
    assert json.loads(config.read_text())["quantization_config"]["quant_method"] == "mxfp4"
