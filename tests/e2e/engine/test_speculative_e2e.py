"""Speculative mode on a real cluster (the coordinator and 2 workers on 127.0.0.1, two
micro-batches in flight, a draft model on the coordinator): every draft source, batched with
WeDLM and AR requests, gives the single-process AR tokens; gRPC and the `openai` package
report the drafts; bad draft fields are refused with the field named."""

from __future__ import annotations

import threading

import openai
import pytest

from common.generation_params import GenerationParams
from tests.support.cluster_harness import (
    cluster_name,
    engine_outputs,
    start_coordinator,
    start_worker,
)
from wedlm_client.client import ClusterError, WedlmClient

PROMPTS = ["the cat sat on the mat and the cat sat", "count 1 2 3 1 2 3", "a b a b a"]
DRAFTS = [("mask", 8), ("lookup", 6), ("model", 4)]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen3", seed=81, num_hidden_layers=6)


@pytest.fixture(scope="module")
def draft_model(checkpoint_dir):
    return checkpoint_dir("llama", seed=82, num_hidden_layers=2)


@pytest.fixture(scope="module")
def cluster(model, draft_model):
    name = cluster_name()
    procs = []
    try:
        workers = []
        for layers in ("2-3", "4-5"):
            proc, address = start_worker(model, name, "--layers", layers, "--no-bonjour")
            procs.append(proc)
            workers += ["--worker", address]
        coord, address = start_coordinator(
            model, name, "--no-bonjour", *workers, "--expect", "2", "--layers", "0-1",
            "--micro-batches", "2", "--http-port", "0", "--draft-model", str(draft_model),
        )  # fmt: skip
        procs.append(coord)
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        coord.expect("serving")
        yield {"address": address, "http": http, "model": model.name}
    finally:
        for p in procs:
            p.stop()


def test_every_draft_source_through_two_workers(cluster, model):
    ar = [(t, GenerationParams(mode="ar", max_tokens=24)) for t in PROMPTS]
    expected = engine_outputs(model, ar)
    jobs = [
        (text, GenerationParams(mode="speculative", draft=d, window=w, max_tokens=24), want)
        for text, want in zip(PROMPTS, expected, strict=True)
        for d, w in DRAFTS
    ]
    jobs += [(t, GenerationParams(threshold=1.0, max_tokens=16), None) for t in PROMPTS]
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        with WedlmClient(cluster["address"], timeout=180) as client:
            results[i] = client.generate(text=jobs[i][0], params=jobs[i][1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    drafted = 0
    for i, (_, params, want) in enumerate(jobs):
        if want is None:
            continue
        got = results[i]
        assert got["tokens"] == want, (params.draft, got["tokens"], want)
        assert got["forwards"] + got["accepted_drafts"] == len(want)
        drafted += got["drafted_tokens"]
    assert drafted > 0


def test_openai_reports_accepted_and_rejected_predictions(cluster):
    with openai.OpenAI(base_url=cluster["http"], api_key="none", max_retries=0) as client:
        reply = client.completions.create(
            model=cluster["model"], prompt=PROMPTS[2], max_tokens=20, temperature=0,
            extra_body={"mode": "speculative", "draft": "lookup", "window": 6},
        )  # fmt: skip
        ar = client.completions.create(
            model=cluster["model"], prompt=PROMPTS[2], max_tokens=20, temperature=0,
            extra_body={"mode": "ar"},
        )  # fmt: skip
        assert reply.choices[0].text == ar.choices[0].text
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
        assert ar.usage.completion_tokens_details is None
        for body, param in (
            ({"mode": "speculative", "draft": "ngram"}, "draft"),
            ({"mode": "ar", "draft": "lookup"}, "draft"),
        ):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(
                    model=cluster["model"], prompt="x", max_tokens=4, extra_body=body
                )
            assert err.value.body["param"] == param, err.value.body


def test_grpc_refuses_bad_draft_fields(cluster):
    with (
        WedlmClient(cluster["address"], timeout=30) as client,
        pytest.raises(ClusterError, match=r"INVALID_ARGUMENT.*draft must be one of"),
    ):
        client.generate(text="x", params=_raw_params(draft="ngram"))


def _raw_params(**fields):
    """GenerationParams that skip validation, to send what a foreign client might."""
    params = GenerationParams(mode="speculative")
    for key, value in fields.items():
        object.__setattr__(params, key, value)
    return params
