"""The coordinator as a pipeline stage and stages relaying to each other (protocol 3), with
real processes on 127.0.0.1: every layout gives the single-process engine's greedy tokens,
a coordinator serves alone and takes workers in as they start, in any order."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
import urllib.request

import pytest

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from tests.support.cluster_harness import (
    cluster_name,
    engine_outputs,
    free_port,
    start_coordinator,
    start_worker,
    wait_until,
)
from wedlm_client.client import WedlmClient

PROMPTS = ["the cat sat on the mat", "count 1 2 3", "a b a b a"]
SETTINGS = [
    GenerationParams(threshold=1.5, max_tokens=20),
    GenerationParams(window=4, threshold=None, penalty=0.1, max_tokens=14),
    GenerationParams(mode="ar", max_tokens=18),
]
JOBS = [(text, params) for text in PROMPTS for params in SETTINGS]


def local_outputs(model) -> list[list[int]]:
    return engine_outputs(model, JOBS)


def concurrent_outputs(address: str) -> list[list[int]]:
    """Every job at once, so that the engine batches them into micro-batches in flight."""
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        text, params = JOBS[i]
        with WedlmClient(address, timeout=180) as client:
            results[i] = client.generate(text=text, params=params)["tokens"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(JOBS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    return [results[i] for i in range(len(JOBS))]


def status(address: str):
    with WedlmClient(address, timeout=30) as client:
        return client.cluster_status()






@pytest.fixture(scope="module")
def dense(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen3", seed=61, num_hidden_layers=5)


@pytest.fixture(scope="module")
def moe(checkpoint_dir):
    return checkpoint_dir("qwen3_moe", seed=62, num_hidden_layers=4)


@pytest.fixture(scope="module")
def dense_expected(dense):
    return local_outputs(dense)


@pytest.fixture(scope="module")
def moe_expected(moe):
    return local_outputs(moe)


LAYOUTS = {  # name: (workers, extra coordinator flags)
    "coordinator-alone": (0, []),
    "coordinator+1": (1, []),
    "coordinator+2": (2, []),
    "no-local-layers+2": (2, ["--no-local-layers"]),
}


def serve(model, layout: str):
    workers, extra = LAYOUTS[layout]
    name = cluster_name()
    procs, listed = [], []
    for _ in range(workers):
        proc, address = start_worker(model, name, "--no-bonjour")
        procs.append(proc)
        listed += ["--worker", address]
    coord, address = start_coordinator(
        model, name, "--no-bonjour", "--expect", str(workers), "--micro-batches", "2",
        *listed, *extra,
    )  # fmt: skip
    procs.append(coord)
    coord.expect("serving")
    return procs, address


def check_layout(address: str, layout: str, num_layers: int) -> None:
    st = status(address)
    workers, extra = LAYOUTS[layout]
    serving = sorted(
        (w for w in st.workers if w.health == "serving"), key=lambda w: w.info.layer_start
    )
    assert st.state == "serving" and len(serving) == workers
    ranges = [(w.info.layer_start, w.info.layer_end) for w in serving]
    if "--no-local-layers" in extra:
        assert st.local_layers == ""
    else:
        start, end = (int(x) for x in st.local_layers.split("-"))
        ranges.insert(0, (start, end))
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers - 1
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(ranges))
    for w, nxt in zip(serving, [*serving[1:], None], strict=False):
        assert w.info.next_stage == (nxt.address if nxt else "")
        assert w.info.plan_epoch == st.plan_epoch


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_layouts_match_single_process(request, family, layout):
    model = request.getfixturevalue(family)
    procs, address = serve(model, layout)
    try:
        assert concurrent_outputs(address) == request.getfixturevalue(f"{family}_expected")
        check_layout(address, layout, {"dense": 5, "moe": 4}[family])
    finally:
        for p in procs:
            p.stop()


def test_coordinator_started_first_waits_then_takes_workers_one_by_one(dense, dense_expected):
    """Listed workers that are not up yet: without layers of its own the coordinator waits
    (NOT_SERVING, status names them), serves once one worker covers the model, and takes
    the second in when it starts."""
    name = cluster_name()
    ports = [free_port(), free_port()]
    listed = [a for p in ports for a in ("--worker", f"127.0.0.1:{p}")]
    coord, address = start_coordinator(
        dense, name, "--no-bonjour", "--no-local-layers", "--wait-for-workers", "300", *listed
    )
    procs = [coord]
    try:
        st = wait_until(lambda: status(address).waiting_for and status(address), 60, "a wait")
        assert st.state == "waiting-for-workers"
        assert f"127.0.0.1:{ports[0]}" in st.waiting_for or "no usable" in st.waiting_for
        time.sleep(2.0)
        assert coord.popen.poll() is None, "the coordinator gave up instead of waiting"
        procs.append(start_worker(dense, name, "--no-bonjour", "--port", str(ports[0]))[0])
        coord.expect("serving")
        assert concurrent_outputs(address) == dense_expected
        assert f"127.0.0.1:{ports[1]}" in status(address).waiting_for
        procs.append(start_worker(dense, name, "--no-bonjour", "--port", str(ports[1]))[0])
        wait_until(
            lambda: (
                sum(w.health == "serving" and w.info.has_layers for w in status(address).workers)
                == 2
            ),
            90,
            "the second worker to be taken in",
        )
        assert concurrent_outputs(address) == dense_expected
        assert status(address).waiting_for == ""
    finally:
        for p in procs:
            p.stop()


def test_worker_joining_a_lone_coordinator_takes_layers_without_losing_a_stream(checkpoint_dir):
    """A coordinator serving the whole model alone; a listed worker answers while a stream
    runs (it was suspended until then): the coordinator re-plans, moves layers to it, and
    the stream ends with the tokens of a run without the change."""
    model = checkpoint_dir("qwen3", seed=63, num_hidden_layers=4, max_position_embeddings=4096)
    long = GenerationParams(mode="ar", max_tokens=3000)
    local = open_local_engine(model)
    seq = local.engine.submit(local.tokenizer.encode("a long story"), long)
    for _ in local.engine.stream([seq]):
        pass
    name = cluster_name()
    worker, waddr = start_worker(model, name, "--no-bonjour")
    os.kill(worker.popen.pid, signal.SIGSTOP)  # listed, but not answering yet
    procs = [worker]
    try:
        coord, address = start_coordinator(model, name, "--no-bonjour", "--worker", waddr)
        procs.append(coord)
        coord.expect("serving")
        st = status(address)
        assert st.local_layers == "0-3" and waddr in st.waiting_for
        got: dict = {}
        progress = []

        def run() -> None:
            with WedlmClient(address, timeout=300) as client:
                for event in client.generate_stream(text="a long story", params=long):
                    if event[0] == "tokens":
                        progress.append(len(event[1]))
                    else:
                        got.update(event[1])

        stream = threading.Thread(target=run)
        stream.start()
        wait_until(lambda: sum(progress) >= 4, 60, "the stream to start")
        os.kill(worker.popen.pid, signal.SIGCONT)
        st = wait_until(
            lambda: (
                (s := status(address)).plan_epoch > st.plan_epoch and s.state == "serving" and s
            ),
            90,
            "a re-plan",
        )
        at_replan = sum(progress)
        stream.join(300)
        assert at_replan < len(seq.output), "the stream ended before the worker joined"
        assert got["finish_reason"] in ("length", "stop")
        assert got["tokens"] == seq.output
        serving = [w for w in st.workers if w.health == "serving"]
        assert [w.address for w in serving] == [waddr] and serving[0].info.has_layers
        assert st.local_layers != "0-3" and st.waiting_for == ""
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGCONT)
            p.stop()


def _gauge(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_warm_start_runs_the_first_shapes_before_readiness(dense):
    """With --warm-up on (auto warms on GPUs only), the coordinator runs the first shapes of
    its bounded set before it serves: the first requests of those shapes add none."""
    name = cluster_name()
    coord, address = start_coordinator(
        dense, name, "--no-bonjour", "--warm-up", "on", "--max-running", "2",
        "--metrics-port", "0",
    )  # fmt: skip
    try:
        url = coord.expect(r"metrics on (http://\S+)").group(1)
        coord.expect("serving")
        warmed = _gauge(url, "wedlm:forward_shapes")
        assert warmed > 10
        jobs = [
            ("hello there", GenerationParams(mode="ar", max_tokens=12)),
            ("a b c", GenerationParams(max_tokens=10)),
            ("x", GenerationParams(window=8, max_tokens=6)),
        ]
        with WedlmClient(address, timeout=120) as client:
            for text, params in jobs:
                assert client.generate(text=text, params=params)["tokens"]
        time.sleep(1.0)  # the gauge is set after each tick
        assert _gauge(url, "wedlm:forward_shapes") == warmed
    finally:
        coord.stop()
