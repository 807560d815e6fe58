"""Coordinators of different models on one host, with the same --state-dir and cluster name,
share one job store: each resumes only its own model's jobs (real processes, real gRPC, two
tiny checkpoints with different vocabularies). A job of another model stays in the store,
untouched, for a coordinator that can run it; a stored job that claims this model but
cannot run on it fails with a clear error, which the client asking for it gets."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time

from common.generation_params import GenerationParams
from common.model_config import load_model_config
from coordinator.service.job_store import JobStore, encode_request
from tests.support.cluster_harness import cluster_name, engine_outputs, start_coordinator
from wedlm_client.client import WedlmClient

SMALL_VOCAB = 320  # model B: model A's ids at or above this are out of its range


def _never_eos(model) -> GenerationParams:
    """AR to exactly max_tokens: long enough that a SIGKILL lands before it ends."""
    eos = load_model_config(model).raw["eos_token_id"]
    return GenerationParams(mode="ar", max_tokens=300, logit_bias=((eos, -100.0),))


def _coordinator(model, name: str, state, *extra: str):
    proc, address = start_coordinator(model, name, "--no-bonjour", "--state-dir", str(state),
                                      *extra)  # fmt: skip
    proc.expect("serving")
    return proc, address


def _stored(path, job_id: str) -> tuple:
    with sqlite3.connect(path) as db:
        return db.execute(
            "SELECT state, result IS NULL, model FROM jobs WHERE job_id = ?", (job_id,)
        ).fetchone()


def test_another_models_coordinator_leaves_the_job_for_one_that_can_run_it(
    checkpoint_dir, tmp_path
):
    model_a = checkpoint_dir("qwen3", seed=71, vocab_size=384, max_position_embeddings=1024)
    model_b = checkpoint_dir("llama", seed=72, vocab_size=SMALL_VOCAB, wedlm_record=False)
    identity_a = load_model_config(model_a).identity
    name, state = cluster_name(), tmp_path / "state"
    store = state / f"jobs-{name}.sqlite"
    params = _never_eos(model_a)
    procs = []
    try:
        first, address = _coordinator(model_a, name, state)
        procs.append(first)
        with WedlmClient(address, timeout=60) as client:
            job_id = client.submit(text="a story for model a", params=params)
        os.kill(first.popen.pid, signal.SIGKILL)  # the job was committed, not finished
        first.popen.wait(10)
        assert _stored(store, job_id) == ("queued", 1, identity_a)  # results come at the end

        second, address = _coordinator(model_b, name, state)  # ready: it runs none of them
        procs.append(second)
        with WedlmClient(address, timeout=60) as client:
            answer = client.generate(text="hello b", params=GenerationParams(max_tokens=6))
            assert answer["finish_reason"] in ("stop", "length") and not answer.get("error")
        log = "".join(second.log)
        kept = re.search(r"job store: (\d+) unfinished jobs of other models are kept for "
                         r"their coordinators \(not run here\): (.*)", log)  # fmt: skip
        assert kept, log
        assert kept[1] == "1" and f"1 of {model_a.name} (model {identity_a})" in kept[2]
        assert "out of range" not in log
        second.popen.send_signal(signal.SIGTERM)
        assert second.wait_exit(30)[0] == 0
        assert _stored(store, job_id)[1:] == (1, identity_a)  # untouched, unfinished

        third, address = _coordinator(model_a, name, state)
        procs.append(third)
        with WedlmClient(address, timeout=120) as client:
            job = client.wait_job(job_id, timeout_s=120)
        assert job.state == "done", job
        (expected,) = engine_outputs(model_a, [("a story for model a", params)])
        assert list(job.result.tokens) == expected and len(expected) == 300
        assert _stored(store, job_id)[:2] == ("done", 0)
    finally:
        for proc in procs:
            proc.stop()


def test_a_stored_job_that_does_not_fit_the_model_fails_clearly(checkpoint_dir, tmp_path):
    model = checkpoint_dir("llama", seed=72, vocab_size=SMALL_VOCAB, wedlm_record=False)
    config = load_model_config(model)
    name, state = cluster_name(), tmp_path / "state"
    injected = JobStore(state / f"jobs-{name}.sqlite", config.identity, model.name)
    request = encode_request([5, SMALL_VOCAB + 10, 900], GenerationParams(max_tokens=4), None)
    injected.accepted("misfit", time.time(), request)  # claims this model; its ids do not fit
    injected.close()
    proc, address = _coordinator(model, name, state)
    try:
        with WedlmClient(address, timeout=60) as client:
            answer = client.generate(text="still serving", params=GenerationParams(max_tokens=6))
            assert not answer.get("error") and answer["tokens"]
            job = client.wait_job("misfit", timeout_s=30)
        assert job.state == "failed", job
        error = job.result.error
        assert error == (
            f"job misfit was accepted before this coordinator started and cannot run on its "
            f"model (identity {config.identity}): prompt token ids out of range "
            f"[0, {SMALL_VOCAB}): [{SMALL_VOCAB + 10}, 900]"
        ), error
        assert "engine thread stopped" not in "".join(proc.log)
    finally:
        proc.stop()
