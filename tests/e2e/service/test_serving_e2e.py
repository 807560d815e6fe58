"""Serving many requests at once on a real two-worker cluster: concurrent streams with
several micro-batches in flight equal the single-process output, disconnects free KV on
every worker, overload is refused at once, deadlines hold, metrics are exported."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from common.generation_params import GenerationParams
from common.proto_gen import wedlm_pb2 as pb
from coordinator.engine.local_engine import open_local_engine
from tests.support.cluster_harness import (
    cluster_name,
    start_coordinator,
    start_worker,
    worker_kv_sequences,
)
from wedlm_client.client import ClusterError, WedlmClient

PROMPTS = [f"request number {i} about {w}" for i, w in enumerate("abcdefgh")]


def params_for(i: int) -> GenerationParams:
    if i % 3 == 2:
        return GenerationParams(mode="ar", max_tokens=16)
    return GenerationParams(threshold=1.5 if i % 2 else None, window=8, max_tokens=16)


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen2", seed=41, num_hidden_layers=4)


@pytest.fixture(scope="module")
def cluster(model):
    name = cluster_name()
    procs, workers = [], []
    try:
        for layers in ("0-1", "2-3"):
            proc, address = start_worker(model, name, "--layers", layers, "--no-bonjour")
            procs.append(proc)
            workers.append(address)
        extra = [a for w in workers for a in ("--worker", w)]
        coord, address = start_coordinator(
            model,
            name,
            "--no-bonjour",
            "--expect",
            "2",
            "--max-running",
            "4",
            "--max-queued",
            "3",
            "--metrics-port",
            "0",
            *extra,
        )
        procs.append(coord)
        metrics = coord.expect(r"metrics on (http://\S+)").group(1)
        coord.expect("serving")
        yield {"address": address, "workers": workers, "metrics": metrics}
    finally:
        for p in procs:
            p.stop()


def test_concurrent_streams_equal_single_process(cluster, model):
    local = open_local_engine(model)
    expected = []
    for i, text in enumerate(PROMPTS[:4]):
        seq = local.engine.submit(local.tokenizer.encode(text), params_for(i))
        for _ in local.engine.stream([seq]):
            pass
        expected.append(seq.output)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        with WedlmClient(cluster["address"], timeout=120) as client:
            results[i] = client.generate(text=PROMPTS[i], params=params_for(i))["tokens"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [results[i] for i in range(4)] == expected


def test_disconnect_releases_kv_on_every_worker(cluster, model):
    identity = open_local_engine(model).engine.config.identity
    with WedlmClient(cluster["address"], timeout=120) as client:
        stream = client.stub.Generate(
            pb.GenerateRequest(text="go on and on", mode="ar", max_tokens=400), timeout=120
        )
        next(stream)  # a token arrived: the sequence holds KV on both workers now
        assert all(worker_kv_sequences(w, identity) >= 1 for w in cluster["workers"])
        stream.cancel()
        # every worker keeps only the rows the prefix cache holds (the cancelled request
        # leaves its own to it): none of a running sequence
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cached = client.cluster_status().prefix_cache.entries
            counts = [worker_kv_sequences(w, identity) - cached for w in cluster["workers"]]
            if counts == [0, 0]:
                break
            time.sleep(0.1)
    assert counts == [0, 0]


def test_overload_is_refused_at_once(cluster):
    with WedlmClient(cluster["address"], timeout=60) as client:
        jobs = [
            client.submit(text="x", params=GenerationParams(mode="ar", max_tokens=200))
            for _ in range(7)  # 4 running + 3 queued
        ]
        start = time.monotonic()
        with pytest.raises(ClusterError) as err:
            client.submit(text="x", params=GenerationParams(mode="ar", max_tokens=200))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - start < 2
        for job in jobs:
            client.cancel_job(job)
        states = [client.get_job(j).state for j in jobs]
        assert all(s in ("cancelled", "done") for s in states), states
        assert states.count("cancelled") >= 3, states


def test_deadline_cancels_a_job(cluster):
    with WedlmClient(cluster["address"], timeout=60) as client:
        req = pb.GenerateRequest(text="slow", mode="ar", max_tokens=400, deadline_s=0.3)
        job_id = client.stub.Submit(req, timeout=10).job_id
        job = client.wait_job(job_id, timeout_s=30)
        assert job.state == "cancelled" and job.result.finish_reason == "deadline"


def test_metrics_are_exported(cluster):
    with WedlmClient(cluster["address"]) as client:
        client.generate(text="metrics", params=GenerationParams(max_tokens=8))
    text = urllib.request.urlopen(cluster["metrics"], timeout=10).read().decode()
    for name in (
        "wedlm:num_requests_running",
        "wedlm:num_requests_waiting",
        "wedlm:kv_cache_usage_rows",
        "wedlm:prompt_tokens_total",
        "wedlm:generation_tokens_total",
        "wedlm:time_to_first_token_seconds_bucket",
        "wedlm:inter_token_latency_seconds_bucket",
        "wedlm:e2e_request_latency_seconds_bucket",
        "wedlm:request_queue_time_seconds_bucket",
        "wedlm:decode_forwards_total",
        "wedlm:tokens_per_forward_bucket",
        "wedlm:micro_batches_in_flight",
        "wedlm:worker_compute_seconds_bucket",
    ):
        assert name in text, name
    assert "wedlm:generation_tokens_total 0.0" not in text
    assert 'wedlm:draft_break_even{rows="1"}' in text  # warm-up off on CPU: 1.0 until timed
