"""Tensor-parallel stages on a real cluster (issue 31): workers started for real on
127.0.0.1, grouped by the coordinator's `--tp` over mlx.distributed's `ring` backend, each
member's layers split by mlx-lm's own Model.shard in a group process. Greedy float32
outputs equal the single-process engine's in AR, WeDLM and speculative modes, dense and
MoE, with several micro-batches in flight and the prefix cache on; a lost member
(killed or frozen) re-plans without it and every stream ends with the fault-free tokens;
a model whose heads do not divide falls back to a pipeline, as `wedlm status` says."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from tests.support.cluster_harness import cluster_name, start_coordinator, start_worker
from wedlm_client.client import WedlmClient
from wedlm_client.status_view import format_status

pytestmark = pytest.mark.e2e
STREAMS = 8
PROMPTS = [f"group {i} hears {w}" for i, w in enumerate("abcdefgh")]
# a lost member is found when a forward's collectives do not finish within this bound
WORKER_ENV = {"WEDLM_GROUP_BOUND_S": "4"}


def params_for(i: int, max_tokens: int = 48) -> GenerationParams:
    if i % 4 == 3:
        return GenerationParams(mode="speculative", draft="mask", window=8, max_tokens=max_tokens)
    if i % 2:
        return GenerationParams(mode="ar", max_tokens=max_tokens)
    return GenerationParams(threshold=1.0, window=8, max_tokens=max_tokens)


def expected_outputs(model, n: int, max_tokens: int) -> list[list[int]]:
    local = open_local_engine(model)
    out = []
    for i, text in enumerate(PROMPTS[:n]):
        seq = local.engine.submit(local.tokenizer.encode(text), params_for(i, max_tokens))
        for _ in local.engine.stream([seq]):
            pass
        out.append(seq.output)
    return out


def start_group_cluster(model, workers: int, *coord_args: str):
    name = cluster_name()
    procs = [start_worker(model, name, "--no-bonjour", env=WORKER_ENV) for _ in range(workers)]
    listed = [a for _, addr in procs for a in ("--worker", addr)]
    coord, address = start_coordinator(
        model, name, "--no-bonjour", *listed, "--expect", str(workers), *coord_args
    )
    coord.expect("serving", timeout=180)
    return dict((addr, p) for p, addr in procs), coord, address


def stop_all(procs) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.popen.pid, signal.SIGCONT)
        p.stop()


def run_streams(address: str, n: int, max_tokens: int, fault=None) -> list[list[int]]:
    results: dict[int, dict] = {}
    progress = [0] * n

    def run(i: int) -> None:
        with WedlmClient(address, timeout=300) as client:
            for event in client.generate_stream(text=PROMPTS[i], params=params_for(i, max_tokens)):
                if event[0] == "tokens":
                    progress[i] += len(event[1])
                else:
                    results[i] = event[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 120
        while min(progress) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        unfinished = sum(p < max_tokens for p in progress)
        assert min(progress) >= 1 and unfinished >= n // 2, progress  # the fault hits mid-stream
        fault()
    for t in threads:
        t.join(300)
    assert all(results[i]["finish_reason"] in ("length", "stop") for i in range(n)), results
    return [results[i]["tokens"] for i in range(n)]


def status_of(address: str):
    with WedlmClient(address) as client:
        return client.cluster_status()


@pytest.fixture(scope="module")
def dense(checkpoint_dir):
    return checkpoint_dir("qwen3", seed=71, num_hidden_layers=4, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def dense_expected(dense):
    return expected_outputs(dense, STREAMS, 48)


def test_two_workers_form_one_stage_and_match_one_process(dense, dense_expected):
    """TP = 2 over two workers (--no-local-layers), 2 micro-batches in flight, prefix
    cache on (the default), AR / WeDLM / speculative streams at once."""
    workers, coord, address = start_group_cluster(
        dense, 2, "--no-local-layers", "--tp", "2", "--micro-batches", "2"
    )
    try:
        status = status_of(address)
        members = [w for w in status.workers if w.health == "serving"]
        leaders = {w.group_leader for w in members}
        assert len(members) == 2 and len(leaders) == 1 and leaders <= {w.address for w in members}
        assert all(w.info.group_size == 2 and w.info.group_backend == "ring" for w in members)
        assert "tensor group" in status.plan_note
        with WedlmClient(address) as client:
            shown = format_status(client.status_dict())  # what `wedlm status` prints
        assert "rank 1 of 2 (ring)" in shown and "plan: tensor group" in shown, shown
        assert run_streams(address, STREAMS, 48) == dense_expected
        # the prompts again: prefix-cache hits fork KV rows inside the group
        assert run_streams(address, STREAMS, 48) == dense_expected
    finally:
        stop_all([*workers.values(), coord])


def test_coordinator_leads_a_group_with_one_worker(dense, dense_expected):
    """Two machines, TP = 2: the coordinator is rank 0 of the group that holds every
    layer (its group process beside its engine), one worker rank 1."""
    workers, coord, address = start_group_cluster(dense, 1, "--tp", "2")
    try:
        status = status_of(address)
        (member,) = [w for w in status.workers if w.health == "serving"]
        assert member.group_leader == "coordinator" and member.info.group_rank == 1
        assert status.local_layers == "0-3", status.local_layers
        assert run_streams(address, STREAMS, 48) == dense_expected
    finally:
        stop_all([*workers.values(), coord])


@pytest.fixture(scope="module")
def moe(checkpoint_dir):
    return checkpoint_dir("qwen3_moe", seed=73, num_hidden_layers=4, max_position_embeddings=1024)


def test_two_stages_of_two_members_moe(moe):
    """TP = 2 x 2 stages (4 members) on a mixture-of-experts model: the coordinator and a
    worker hold the first layers, two workers the rest; 2 micro-batches in flight."""
    expected = expected_outputs(moe, STREAMS, 32)
    workers, coord, address = start_group_cluster(moe, 3, "--tp", "2", "--micro-batches", "2")
    try:
        status = status_of(address)
        leaders = [w.group_leader for w in status.workers if w.health == "serving"]
        assert "coordinator" in leaders and len(set(leaders)) == 2, status.plan_note
        assert all(leaders) and status.local_layers, status.local_layers
        assert run_streams(address, STREAMS, 32) == expected
    finally:
        stop_all([*workers.values(), coord])


LOSSES = {
    "follower-killed": (signal.SIGKILL, ("--no-local-layers",), 2),
    "follower-frozen": (signal.SIGSTOP, ("--no-local-layers",), 2),
    "coordinators-member-killed": (signal.SIGKILL, (), 1),
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_lost_member_replans_without_it(dense, loss):
    """A member's machine lost while 8 streams run: a follower of a group of two workers
    killed (kill -9) or frozen (SIGSTOP), or the worker in the coordinator's group killed.
    The leader's forward does not finish within the bound (or fails at once), the
    coordinator plans again with the survivor alone, re-prefills, and every stream ends
    with the tokens of a run without the fault."""
    fault, args, count = LOSSES[loss]
    expected = expected_outputs(dense, STREAMS, 160)
    workers, coord, address = start_group_cluster(dense, count, *args, "--tp", "2")
    processes = []
    try:
        status = status_of(address)
        victim = next(
            w.address for w in status.workers if w.group_leader and w.group_leader != w.address
        )
        # the member's machine is lost: its worker and its group process alike
        machine = psutil.Process(workers[victim].popen.pid)
        processes = [machine, *machine.children(recursive=True)]
        outputs = run_streams(
            address, STREAMS, 160, lambda: [p.send_signal(fault) for p in processes]
        )
        assert outputs == expected
        status = status_of(address)
        serving = [w for w in status.workers if w.health == "serving"]
        assert all(w.info.group_size == 0 for w in serving)
        assert victim not in {w.address for w in serving}
        assert len(serving) == count - 1
    finally:
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)
        stop_all([*workers.values(), coord])


def test_heads_that_do_not_divide_fall_back_to_a_pipeline(dense, dense_expected):
    """--tp 3 on a model with 4 attention heads: a pipeline, and status says why."""
    workers, coord, address = start_group_cluster(dense, 3, "--tp", "3")
    try:
        status = status_of(address)
        assert "do not divide by 3" in status.plan_note, status.plan_note
        assert all(w.info.group_size == 0 for w in status.workers)
        assert run_streams(address, 4, 48) == dense_expected[:4]
    finally:
        stop_all([*workers.values(), coord])


def test_a_member_lost_during_warm_up_plans_again(dense, dense_expected):
    """The coordinator's group loses its worker while warming up (--warm-up on, which a
    GPU runs by default): the coordinator plans again without it and serves, rather than
    ending with the warm-up's error."""
    name = cluster_name()
    worker, addr = start_worker(dense, name, "--no-bonjour", env=WORKER_ENV)
    coord, address = start_coordinator(dense, name, "--no-bonjour", "--worker", addr,
                                       "--expect", "1", "--tp", "2", "--warm-up", "on",
                                       env=WORKER_ENV)  # fmt: skip
    try:
        coord.expect("plan 1", timeout=180)
        time.sleep(3)  # into the warm-up's forwards
        worker.popen.kill()
        coord.expect("warm-up stopped, a stage was lost", timeout=120)
        coord.expect("serving", timeout=180)
        status = status_of(address)
        assert status.local_layers == "0-3"
        assert all(w.info.group_size == 0 for w in status.workers)
        assert run_streams(address, 4, 48) == dense_expected[:4]
    finally:
        stop_all([worker, coord])
