"""A DiffusionGemma model served by a real cluster: two worker processes holding layer
ranges, the coordinator holding none, real gRPC and the OpenAI HTTP API. Faithful mode
through the stages equals mlx-vlm's reference sampler; turbo requests stream, run
batched and can be cancelled."""

from __future__ import annotations

import threading

import openai
import pytest

from common.generation_params import GenerationParams
from tests.engine.test_diffusion import PROMPTS
from tests.support.cluster_harness import cluster_name, start_coordinator, start_worker
from tests.support.diffusion_checkpoints import make_diffusion_checkpoint
from tests.support.reference_diffusion import reference_tokens
from wedlm_client.client import ClusterError, WedlmClient


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_diffusion_checkpoint(tmp_path_factory.mktemp("dgc") / "q4", seed=4, bits=4)


@pytest.fixture(scope="module")
def cluster(model):
    name = cluster_name()
    procs, workers = [], []
    try:
        for layers in ("0-1", "2-3"):
            proc, address = start_worker(model, name, "--layers", layers, "--no-bonjour")
            procs.append(proc)
            workers += ["--worker", address]
        coord, address = start_coordinator(
            model, name, "--no-bonjour", "--no-local-layers", "--expect", "2", *workers,
            "--http-port", "0", "--max-running", "4", "--metrics-port", "0",
        )  # fmt: skip
        procs.append(coord)
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        metrics = coord.expect(r"metrics on (http://\S+/metrics)").group(1)
        coord.expect("serving")
        yield {"address": address, "http": http, "model": model.name, "metrics": metrics}
    finally:
        for p in procs:
            p.stop()


def test_faithful_through_two_workers_equals_reference(cluster, model):
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:  # concurrent requests: their canvases share forwards
        params = GenerationParams(mode="diffusion", sampler="faithful", max_tokens=40, seed=i)
        with WedlmClient(cluster["address"], timeout=120) as client:
            results[i] = client.generate(ids=PROMPTS[i], params=params)["tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(PROMPTS):
        assert results[i] == reference_tokens(model, prompt, 40, seed=i)


def test_turbo_through_two_workers_equals_one_process(cluster, model):
    """Turbo's compacted forwards (scattered positions, canvas extents) over the wire give
    what they give in one process."""
    from tests.engine.test_diffusion import engine_of, run

    params = [GenerationParams(max_tokens=40 + 8 * i, seed=i) for i in range(len(PROMPTS))]
    engine = engine_of(model)
    local = run(engine, list(zip(PROMPTS, params, strict=True)))
    assert engine.scheduler.compacted_rows > 0
    with WedlmClient(cluster["address"], timeout=120) as client:
        for prompt, p, seq in zip(PROMPTS, params, local, strict=True):
            assert client.generate(ids=prompt, params=p)["tokens"] == seq.output


def test_turbo_streams_over_grpc_and_http(cluster):
    with WedlmClient(cluster["address"], timeout=120) as client:
        events = list(
            client.generate_stream(ids=PROMPTS[0], params=GenerationParams(max_tokens=40))
        )
    chunks = [e for e in events if e[0] == "tokens"]
    final = next(e for e in events if e[0] == "final")[1]
    assert len(chunks) >= 2  # canvases stream as they commit (16 tokens each here)
    assert sum(len(e[1]) for e in chunks) == len(final["tokens"])
    assert len(final["tokens"]) == 40 or final["finish_reason"] == "stop"

    with openai.OpenAI(base_url=cluster["http"], api_key="none", max_retries=0) as api:
        reply = api.completions.create(
            model=cluster["model"], prompt="the cat", max_tokens=20,
            extra_body={"sampler": "faithful", "seed": 3},
        )  # fmt: skip
        assert reply.usage.completion_tokens == 20
        stream = api.completions.create(
            model=cluster["model"], prompt="the cat", max_tokens=20, stream=True
        )
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert isinstance(text, str)
        with pytest.raises(openai.BadRequestError, match="decodes by diffusion") as err:
            api.completions.create(
                model=cluster["model"], prompt="x", max_tokens=4, extra_body={"mode": "wedlm"}
            )
        assert err.value.body["param"] == "mode"


def test_metrics_count_canvases(cluster):
    import httpx

    with WedlmClient(cluster["address"], timeout=60) as client:
        client.generate(ids=PROMPTS[0], params=GenerationParams(max_tokens=32, seed=1))
    text = httpx.get(cluster["metrics"], timeout=10).text
    canvases = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("wedlm:diffusion_canvases_total")
    )
    assert canvases >= 2
    assert "wedlm:diffusion_forwards_per_canvas_count" in text


def test_bad_diffusion_requests_get_clear_errors(cluster):
    with (
        WedlmClient(cluster["address"], timeout=60) as client,
        pytest.raises(ClusterError, match="decodes by diffusion"),
    ):
        client.generate(ids=[1, 2], params=GenerationParams(mode="ar"))


def test_cancel_a_diffusion_job(cluster):
    with WedlmClient(cluster["address"], timeout=60) as client:
        params = GenerationParams(max_tokens=400, steps=40, sampler="faithful")
        job_id = client.submit(None, PROMPTS[1], False, params, 0.0)
        client.cancel_job(job_id)
        job = client.wait_job(job_id, 30)
        assert job.state == "cancelled" and job.committed_tokens < 400
        # the cluster goes on serving: a request after the cancelled one completes
        again = client.generate(ids=PROMPTS[0], params=GenerationParams(max_tokens=16))
        assert len(again["tokens"]) == 16


def test_worker_loss_mid_canvas_changes_no_token(model):
    """Three workers found over Bonjour; while four faithful requests denoise, a middle
    worker is killed: the coordinator re-plans over the others, re-prefills every request's
    committed history, and each canvas goes on from its state and random stream (its next
    forward whole): every output still equals mlx-vlm's."""
    import os
    import signal
    import time

    name = cluster_name()
    procs = [start_worker(model, name)[0] for _ in range(3)]
    coord, address = start_coordinator(model, name, "--expect", "3")
    procs.append(coord)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(4)]
    expected = [reference_tokens(model, p, 160, seed=i) for i, p in enumerate(prompts)]
    results: dict[int, list[int]] = {}
    progress = [0] * len(prompts)

    def one(i: int) -> None:
        params = GenerationParams(mode="diffusion", sampler="faithful", max_tokens=160, seed=i)
        with WedlmClient(address, timeout=300) as client:
            for event in client.generate_stream(ids=prompts[i], params=params):
                if event[0] == "tokens":
                    progress[i] += len(event[1])
                else:
                    results[i] = event[1]

    try:
        coord.expect("serving")
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while sum(progress) < 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        mid_way = [0 < n < len(e) for n, e in zip(progress, expected, strict=True)]
        assert sum(mid_way) >= 2, (progress, [len(e) for e in expected])
        os.kill(procs[1].popen.pid, signal.SIGKILL)
        for t in threads:
            t.join(300)
        for i in range(len(prompts)):
            assert results[i]["tokens"] == expected[i]
        with WedlmClient(address) as client:
            status = client.cluster_status()
        assert sum(w.health == "serving" for w in status.workers) == 2  # it re-planned
    finally:
        for p in procs:
            p.stop()
