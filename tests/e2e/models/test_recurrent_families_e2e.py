"""Hybrid families with recurrent state through 2 stages: a real coordinator (the first
layers, embedding and head) and a real worker (the rest) on 127.0.0.1, prompts of
different lengths at once (batched into micro-batches in flight). Each stage keeps the
states of its own recurrent layers; every request's greedy tokens equal mlx-lm's own
`generate_step`; a conversation's next turn forks its whole cached state on both stages;
a mode that would take rows back is refused by the coordinator; a worker killed
mid-generation is replayed on the others."""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest

from common.generation_params import GenerationParams
from common.tokenizer import Tokenizer
from tests.models.test_recurrent_families import SPECS
from tests.support.checkpoints import make_mlx_checkpoint, mlx_lm_greedy
from tests.support.cluster_harness import cluster_name, start_coordinator, start_worker
from tests.support.family_cluster import encode_all, mlx_lm_tokens, streams_with_fault, three_stages
from wedlm_client.client import ClusterError, WedlmClient

pytestmark = pytest.mark.e2e

PROMPTS = [
    "once upon a time there was a little robot who liked to count",
    "the quick brown fox",
    "she sells sea shells by the sea shore",
]
MAX_TOKENS = 12
STREAMS = [f"stream {i} says {w}" for i, w in enumerate("abcd")]
STREAM_TOKENS = 96


def expected(path) -> list[list[int]]:
    tok = Tokenizer(path)
    return [mlx_lm_greedy(path, tok.encode(t), MAX_TOKENS, tok.stop_ids) for t in PROMPTS]


def concurrent(address: str) -> list[list[int]]:
    results: dict[int, list[int]] = {}
    params = GenerationParams(mode="ar", max_tokens=MAX_TOKENS)

    def one(i: int) -> None:
        with WedlmClient(address, timeout=180) as client:
            results[i] = client.generate(text=PROMPTS[i], params=params)["tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    return [results[i] for i in range(len(PROMPTS))]


# layer 0 (recurrent) on the coordinator; the worker holds 1-3: attention, then a state
# layer, then Qwen3-Next's attention / Nemotron-H's cacheless MLP layer
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_two_stages_match_mlx_lm(family, tmp_path):
    path = make_mlx_checkpoint(tmp_path / family, family, seed=3, spec=SPECS[family])
    name = cluster_name()
    worker, address = start_worker(path, name, "--no-bonjour", "--layers", "1-3")
    procs = [worker]
    try:
        coord, grpc_address = start_coordinator(
            path, name, "--no-bonjour", "--expect", "1", "--worker", address,
            "--layers", "0-0", "--micro-batches", "2",
        )  # fmt: skip
        procs.append(coord)
        coord.expect("serving")
        # admission counts each sequence's state once (fixed bytes, not per token)
        assert any("recurrent state counts as" in line for line in coord.log), coord.log
        got = concurrent(grpc_address)
        assert got == expected(path)
        # the next turn of the first conversation forks its whole entry on both stages
        tok = Tokenizer(path)
        turn = tok.encode(PROMPTS[0]) + got[0] + tok.encode(" and then")
        with WedlmClient(grpc_address, timeout=120) as client:
            again = client.generate(ids=turn, params=GenerationParams(mode="ar", max_tokens=8))
        assert again["cached_tokens"] >= len(turn) - len(tok.encode(" and then")) - 1
        assert again["tokens"] == mlx_lm_greedy(path, turn, 8, tok.stop_ids)
        with (
            WedlmClient(grpc_address, timeout=60) as client,
            pytest.raises(ClusterError) as refused,
        ):
            client.generate(text=PROMPTS[1], params=GenerationParams(mode="wedlm"))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"mode wedlm is not served for {family}" in str(refused.value)
    finally:
        for p in procs:
            p.stop()


def test_a_killed_worker_is_replayed(tmp_path):
    """Three stages (the coordinator and two workers that take the layers they are
    given); 4 AR streams at once; one worker killed mid-generation: the states of the
    layers it held are rebuilt on the others from each stream's tokens."""
    # seed 5: no stream stops early (the fault must land mid-stream in all of them)
    path = make_mlx_checkpoint(tmp_path / "m", "qwen3_next", seed=5, spec=SPECS["qwen3_next"])
    with three_stages(path) as (workers, grpc_address):
        prompts = encode_all(path, STREAMS)
        victim = workers[1][0].popen.pid
        got = streams_with_fault(
            grpc_address, prompts, STREAM_TOKENS, lambda: os.kill(victim, signal.SIGKILL)
        )
        assert got == mlx_lm_tokens(path, prompts, STREAM_TOKENS)


def test_a_worker_fetches_a_mamba_hybrids_layers(tmp_path):
    """A worker without the model fetches Nemotron-H's layers 1-3 from the coordinator
    (cut from the checkpoint by their `backbone.layers.N` names) and serves their states."""
    from tests.support.cluster_harness import start_fetching_worker

    path = make_mlx_checkpoint(tmp_path / "m", "nemotron_h", seed=3, spec=SPECS["nemotron_h"])
    name = cluster_name()
    worker, address = start_fetching_worker(name, tmp_path / "cache")
    procs = [worker]
    try:
        coord, grpc_address = start_coordinator(
            path, name, "--no-bonjour", "--expect", "1", "--worker", address,
            "--layers", "0-0", "--micro-batches", "2",
        )  # fmt: skip
        procs.append(coord)
        coord.expect("serving", timeout=240)
        assert concurrent(grpc_address) == expected(path)
    finally:
        for p in procs:
            p.stop()
