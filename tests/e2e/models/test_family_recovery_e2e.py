"""New families on real clusters (coordinator and workers on 127.0.0.1), greedy float32
tokens equal to mlx-lm's own `generate_step` for gpt-oss (sliding windows of 8, sinks,
MoE) and DeepSeek V3 (MLA's latent KV, a dense first layer, then experts):

- through 2 stages, the prefix cache on and off: a repeated prompt and prompts that share
  a prefix longer than the window (the on cluster serves most of it from cached rows);
  requests batched with others at once (2 micro-batches in flight) give their solo tokens;
- after a worker is killed (SIGKILL) mid-generation: the coordinator plans again without
  it, re-prefills every stream's tokens and finishes them exactly."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.checkpoints import make_mlx_checkpoint
from tests.support.cluster_harness import cluster_name, start_worker
from tests.support.family_cluster import (
    check_prefixes,
    coordinator_before,
    encode_all,
    mlx_lm_tokens,
    streams_with_fault,
    three_stages,
)
from wedlm_client.client import WedlmClient

pytestmark = pytest.mark.e2e
FAMILIES = ["gpt_oss", "deepseek_v3"]
STREAMS = [f"stream {i} says {w}" for i, w in enumerate("abcd")]
STREAM_TOKENS = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-recovery-e2e")
    return {f: make_mlx_checkpoint(root / f, f, seed=5) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_on_and_off_and_batching_through_two_stages(models, family):
    path = models[family]
    for cache in (True, False):
        name = cluster_name()
        worker, address = start_worker(path, name, "--no-bonjour", "--layers", "2-3")
        procs = [worker]
        try:
            flags = [] if cache else ["--no-prefix-cache"]
            coord, grpc = coordinator_before(
                path, name, address, "--layers", "0-1", "--micro-batches", "2", *flags
            )
            procs.append(coord)
            check_prefixes(grpc, path, cached=cache)
        finally:
            for p in procs:
                p.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_killed_worker_is_replayed(models, family):
    """Three stages (the coordinator and two workers that take the layers they are
    given); 4 AR streams at once; one worker killed mid-generation."""
    path = models[family]
    with three_stages(path) as (workers, grpc):
        with WedlmClient(grpc) as client:
            before = client.cluster_status()
        held = {w.address: w.info.has_layers for w in before.workers if w.health == "serving"}
        assert held == {workers[0][1]: True, workers[1][1]: True}, held  # 3 stages
        prompts = encode_all(path, STREAMS)
        victim = workers[1][0].popen.pid
        got = streams_with_fault(
            grpc, prompts, STREAM_TOKENS, lambda: os.kill(victim, signal.SIGKILL)
        )
        assert got == mlx_lm_tokens(path, prompts, STREAM_TOKENS)
        with WedlmClient(grpc) as client:
            after = client.cluster_status()
        serving = [w.address for w in after.workers if w.health == "serving"]
        assert serving == [workers[0][1]], serving
