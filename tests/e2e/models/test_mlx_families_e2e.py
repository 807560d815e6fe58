"""Families served because mlx-lm has them, through 2 stages: a real coordinator (the first
layers, embedding and head) and a real worker (the rest) on 127.0.0.1, requests at once
(batched into micro-batches in flight): every request's greedy tokens equal mlx-lm's own
`generate_step`. Sliding-window layers sit on both sides of the split."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checkpoints import make_mlx_checkpoint
from tests.support.cluster_harness import cluster_name, start_fetching_worker, start_worker
from tests.support.family_cluster import at_once, coordinator_before, encode_all, mlx_lm_tokens

# gemma3: the multimodal layout (layers at language_model.model.layers); deepseek_v3: MLA;
# llama4: chunked layers; gemma4: MoE and a tuple-returning layer in the multimodal layout;
# mistral3_ministral3: layers called with the mask by name; kimi_k25: MLA, multimodal
FAMILIES = [
    "gpt_oss",
    "gemma3_text",
    "gemma3",
    "glm4",
    "deepseek_v3",
    "llama4",
    "gemma4",
    "mistral3_ministral3",
    "kimi_k25",
]
PROMPTS = [
    "once upon a time there was a little robot who liked to count",
    "the quick brown fox",
    "she sells sea shells by the sea shore",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-families-e2e")
    return {f: make_mlx_checkpoint(root / f, f, seed=5) for f in FAMILIES}


def expected(path: Path) -> list[list[int]]:
    return mlx_lm_tokens(path, encode_all(path, PROMPTS), MAX_TOKENS)


def served_through(path: Path, name: str, worker, address: str, layers: str) -> list[list[int]]:
    """A coordinator holding `layers` in front of `worker`: the prompts' tokens through it,
    sent at once."""
    procs = [worker]
    try:
        coord, grpc = coordinator_before(path, name, address, "--layers", layers,
                                         "--micro-batches", "2")  # fmt: skip
        procs.append(coord)
        return [r["tokens"] for r in at_once(grpc, encode_all(path, PROMPTS), MAX_TOKENS)]
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stages_match_mlx_lm(models, family):
    path = models[family]
    name = cluster_name()
    worker, address = start_worker(path, name, "--no-bonjour", "--layers", "2-3")
    assert served_through(path, name, worker, address, "0-1") == expected(path)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
def test_a_worker_fetches_a_new_familys_layers(models, family, tmp_path):
    """A worker without the model fetches its layers from the coordinator (the layer files
    are cut from the checkpoint by tensor name, the multimodal layout's too) and serves
    their sliding layers."""
    path = models[family]
    name = cluster_name()
    worker, address = start_fetching_worker(name, tmp_path / "cache")
    assert served_through(path, name, worker, address, "0-0") == expected(path)
