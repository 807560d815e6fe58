"""Families mlx-lm can shard, through a TP=2 tensor group: the coordinator is rank 0 of a
group with one real worker (rank 1) over mlx.distributed's ring backend on 127.0.0.1, each
member's layers split by mlx-lm's own `Model.shard` (gpt-oss: sliding windows, sinks and
MoE experts; DeepSeek V3: MLA heads, a dense first layer, routed and shared experts;
Qwen3.5: gated delta-net layers' recurrent state between full-attention layers, its layers
at language_model.model.layers and its shard reached through `self.language_model`).
A repeated prompt, prompts sharing a prefix past the window (forked from the prefix cache
inside the group) and requests at once: every request's greedy float32 tokens equal
mlx-lm's `generate_step`, and still after the worker is killed mid-generation (the
coordinator plans again alone and replays the streams).
A family mlx-lm cannot shard is refused at start with one line when --tp asks for a group."""

from __future__ import annotations

import psutil
import pytest

from tests.models.test_recurrent_families import SPECS  # Qwen3.5: its multimodal layout
from tests.support.checkpoints import make_mlx_checkpoint
from tests.support.cluster_harness import cluster_name, spawn, start_worker
from tests.support.family_cluster import (
    check_prefixes,
    coordinator_before,
    encode_all,
    mlx_lm_tokens,
    streams_with_fault,
)
from wedlm_client.client import WedlmClient

pytestmark = pytest.mark.e2e
# a lost member is found when a forward's collectives do not finish within this bound
GROUP_ENV = {"WEDLM_GROUP_BOUND_S": "10"}
STREAMS = [f"stream {i} says {w}" for i, w in enumerate("abcd")]


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen3_5"])
def test_tp2_group_matches_mlx_lm(family, tmp_path):
    path = make_mlx_checkpoint(tmp_path / family, family, seed=5, spec=SPECS.get(family))
    name = cluster_name()
    worker, address = start_worker(path, name, "--no-bonjour", env=GROUP_ENV)
    procs = [worker]
    try:
        coord, grpc = coordinator_before(path, name, address, "--tp", "2", env=GROUP_ENV)
        procs.append(coord)
        with WedlmClient(grpc) as client:
            status = client.cluster_status()
        (member,) = [w for w in status.workers if w.health == "serving"]
        assert member.group_leader == "coordinator" and member.info.group_rank == 1
        assert member.info.group_size == 2 and member.info.group_backend == "ring"
        assert "tensor group" in status.plan_note, status.plan_note
        check_prefixes(grpc, path, cached=True, forks_anywhere=family != "qwen3_5")
        # the member's machine is lost mid-generation (its worker and its group process):
        # the coordinator plans again alone and replays every stream
        machine = psutil.Process(worker.popen.pid)
        lost = [machine, *machine.children(recursive=True)]
        prompts = encode_all(path, STREAMS)
        got = streams_with_fault(grpc, prompts, 96, lambda: [p.kill() for p in lost])
        assert got == mlx_lm_tokens(path, prompts, 96)
        with WedlmClient(grpc) as client:
            after = client.cluster_status()
        assert after.local_layers == "0-3", after.local_layers
        assert not [w for w in after.workers if w.health == "serving"]
    finally:
        for p in procs:
            p.stop()


def test_a_family_without_shard_is_refused_at_start(tmp_path):
    """Gemma 3 has no `shard` in mlx-lm: --tp 2 stops the start with one line that says
    so and what to use instead (--tp auto plans it as stages)."""
    path = make_mlx_checkpoint(tmp_path / "gemma3_text", "gemma3_text", seed=5)
    proc = spawn(
        "coordinator.service.server_cli", "serve", "--model", str(path), "--port", "0",
        "--cluster", cluster_name(), "--no-bonjour", "--state-dir", "none", "--tp", "2",
    )  # fmt: skip
    try:
        code, output = proc.wait_exit()
    finally:
        proc.stop()
    line = (
        "gemma3_text cannot be split across a tensor group: mlx-lm has no shard for it; use stages"
    )
    assert code == 1 and f"wedlm-coordinator: error: --tp 2: {line}\n" in output, output
    assert "Traceback" not in output, output
