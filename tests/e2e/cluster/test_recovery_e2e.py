"""Worker loss on a real cluster: while 8 streams generate (WeDLM, AR and speculative), a
middle or the last worker of the chain is killed (and restarted), or suspended. Every stream
completes with exactly the tokens of a run without the fault (greedy, float32)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from tests.support.cluster_harness import cluster_name, start_coordinator, start_worker
from wedlm_client.client import WedlmClient

STREAMS = 8
PROMPTS = [f"stream {i} says {w}" for i, w in enumerate("abcdefgh")]


def params_for(i: int) -> GenerationParams:
    if i % 4 == 3:  # speculative, drafts by prompt lookup and from mask slots
        draft = "lookup" if i == 3 else "mask"
        return GenerationParams(mode="speculative", draft=draft, window=8, max_tokens=160)
    if i % 2:
        return GenerationParams(mode="ar", max_tokens=160)
    return GenerationParams(threshold=1.0, window=8, max_tokens=160)


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("qwen3", seed=51, num_hidden_layers=6, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def expected(model):
    local = open_local_engine(model)
    out = []
    for i, text in enumerate(PROMPTS):
        seq = local.engine.submit(local.tokenizer.encode(text), params_for(i))
        for _ in local.engine.stream([seq]):
            pass
        out.append(seq.output)
    return out


def run_streams(address: str, fault) -> list[list[int]]:
    """Start the streams, apply `fault` once every stream has tokens, wait for all."""
    results: dict[int, list[int]] = {}
    progress = [0] * STREAMS

    def run(i: int) -> None:
        with WedlmClient(address, timeout=300) as client:
            for event in client.generate_stream(text=PROMPTS[i], params=params_for(i)):
                if event[0] == "tokens":
                    progress[i] += len(event[1])
                else:
                    results[i] = event[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while min(progress) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert min(progress) >= 4 and max(progress) < 100, progress  # the fault hits mid-stream
    fault()
    for t in threads:
        t.join(300)
    assert all(results[i]["finish_reason"] in ("length", "stop") for i in range(STREAMS)), results
    return [results[i]["tokens"] for i in range(STREAMS)]


def start_cluster(model, name, layers=(None, None, None)):
    workers = []
    for fixed in layers:
        extra = ["--layers", fixed] if fixed else []
        workers.append(start_worker(model, name, *extra))
    coord, address = start_coordinator(model, name, "--expect", str(len(layers)))
    coord.expect("serving")
    return workers, coord, address


def stop_all(procs) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.popen.pid, signal.SIGCONT)
        p.stop()


# The coordinator holds the first layers: workers 0, 1, 2 are stages 2, 3, 4 of 4, so
# worker 1 is a middle stage (its predecessor's relay to it breaks) and worker 2 the last.
STAGES = {"middle": 1, "last": 2}


@pytest.mark.parametrize("stage", list(STAGES))
def test_kill_one_of_three_workers(model, expected, stage):
    name = cluster_name()
    workers, coord, address = start_cluster(model, name)
    try:
        victim = workers[STAGES[stage]][0]
        outputs = run_streams(address, lambda: os.kill(victim.popen.pid, signal.SIGKILL))
        assert outputs == expected
        with WedlmClient(address) as client:
            status = client.cluster_status()
        assert sum(w.health == "serving" for w in status.workers) == 2
    finally:
        stop_all([w for w, _ in workers] + [coord])


def test_killed_fixed_worker_restarts_and_rejoins(model, expected):
    name = cluster_name()
    workers, coord, address = start_cluster(model, name, ("0-1", "2-3", "4-5"))
    restarted = []

    def kill_and_restart():
        os.kill(workers[1][0].popen.pid, signal.SIGKILL)
        time.sleep(1.0)  # streams stall: layers 2-3 have no worker until it is back
        restarted.append(start_worker(model, name, "--layers", "2-3")[0])

    try:
        assert run_streams(address, kill_and_restart) == expected
    finally:
        stop_all([w for w, _ in workers] + restarted + [coord])


@pytest.mark.parametrize("stage", list(STAGES))
def test_suspended_worker_is_detected_and_replaced(model, expected, stage):
    name = cluster_name()
    workers, coord, address = start_cluster(model, name)
    try:
        victim = workers[STAGES[stage]][0]
        start = time.monotonic()
        outputs = run_streams(address, lambda: os.kill(victim.popen.pid, signal.SIGSTOP))
        assert outputs == expected
        assert time.monotonic() - start < 120
    finally:
        stop_all([w for w, _ in workers] + [coord])


def test_coordinator_restart_loses_no_accepted_job(model, tmp_path):
    """Jobs are kept in SQLite: after the coordinator is killed and started again, the
    finished result is still there and the queued jobs run to the same tokens."""
    name = cluster_name()
    worker, _ = start_worker(model, name)
    state = ["--state-dir", str(tmp_path), "--max-running", "1"]
    coord, address = start_coordinator(model, name, "--expect", "1", *state)
    coord.expect("serving")
    procs = [worker, coord]
    try:
        quick = GenerationParams(mode="ar", max_tokens=8)
        slow = GenerationParams(mode="ar", max_tokens=600)
        with WedlmClient(address, timeout=60) as client:
            done_id = client.submit(text="first", params=quick)
            assert client.wait_job(done_id, timeout_s=60).state == "done"
            first = list(client.get_job(done_id).result.tokens)
            running_id = client.submit(text="long one", params=slow)
            queued_id = client.submit(text="second", params=quick)
            assert client.get_job(queued_id).state == "queued"
        os.kill(coord.popen.pid, signal.SIGKILL)
        coord.popen.wait(10)
        coord, address = start_coordinator(model, name, "--expect", "1", *state)
        procs.append(coord)
        coord.expect("serving")
        with WedlmClient(address, timeout=120) as client:
            again = client.get_job(done_id)
            assert again.state == "done" and list(again.result.tokens) == first
            for job_id in (queued_id, running_id):
                assert client.wait_job(job_id, timeout_s=120).state == "done"
        local = open_local_engine(model)
        seq = local.engine.submit(local.tokenizer.encode("second"), quick)
        for _ in local.engine.stream([seq]):
            pass
        with WedlmClient(address) as client:
            assert list(client.get_job(queued_id).result.tokens) == seq.output
    finally:
        stop_all(procs)
