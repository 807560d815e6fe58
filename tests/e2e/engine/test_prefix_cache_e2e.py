"""The prefix cache on a real cluster (the coordinator holding layers 0-1 and 2 workers on
127.0.0.1, two micro-batches in flight): multi-turn conversations in AR and WeDLM mode and
concurrent requests sharing a system prompt give the single-process tokens while most of
their prompts come from the stages' cached rows; a worker killed between turns drops the
cache and the next turn is still exact; status, metrics and the `openai` package's usage
report the cache; `--no-prefix-cache` turns it off; bad budgets are refused."""

from __future__ import annotations

import os
import signal
import threading
import urllib.request

import openai
import pytest

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from tests.support.cluster_harness import cluster_name, spawn, start_coordinator, start_worker
from wedlm_client.client import WedlmClient
from wedlm_client.status_view import format_status

SYSTEM = (
    "<|im_start|>system\nYou are a careful robot that counts: one two three four five six "
    "seven eight nine ten, and answers briefly.<|im_end|>\n"
)
QUESTIONS = ["what comes after five", "the quick brown fox", "she sells sea shells", "def main"]
MODES = {
    "ar": GenerationParams(mode="ar", max_tokens=20),
    "wedlm": GenerationParams(threshold=1.0, window=8, max_tokens=20),
}


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen3", seed=71, num_hidden_layers=6)


@pytest.fixture(scope="module")
def reference(model):
    """The cache-off single-process engine: tokens for any (ids, params)."""
    local = open_local_engine(model)

    def run(ids: list[int], params: GenerationParams) -> list[int]:
        seq = local.engine.submit(ids, params)
        for _ in local.engine.stream([seq]):
            pass
        return seq.output

    run.encode = local.tokenizer.encode
    return run


def _start(model, *extra: str, fixed: bool = True):
    """fixed=False: the workers take whatever layers the plan gives them (a re-plan after
    losing one moves its layers to the others)."""
    name = cluster_name()
    procs, workers = [], []
    for layers in ("2-3", "4-5"):
        pinned = ["--layers", layers] if fixed else []
        proc, address = start_worker(model, name, *pinned, "--no-bonjour")
        procs.append(proc)
        workers += ["--worker", address]
    coord, address = start_coordinator(
        model, name, "--no-bonjour", *workers, "--expect", "2", "--layers", "0-1",
        "--micro-batches", "2", "--http-port", "0", "--metrics-port", "0", *extra,
    )  # fmt: skip
    procs.append(coord)
    http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
    metrics = coord.expect(r"metrics on (http://\S+)").group(1)
    coord.expect("serving")
    return {"address": address, "http": http, "metrics": metrics, "procs": procs}


@pytest.fixture(scope="module")
def cluster(model):
    started = _start(model)
    yield started
    for p in started["procs"]:
        p.stop()


def _conversation(client, reference, params, turns: int = 3, then=None) -> list[dict]:
    history = reference.encode(SYSTEM)
    results = []
    for turn in range(turns):
        if then is not None and turn == turns - 1:
            then()
        ids = history + reference.encode(f"<|im_start|>user\nturn {turn}<|im_end|>\n")
        got = client.generate(ids=ids, params=params)
        assert got["tokens"] == reference(ids, params), (turn, params.mode)
        results.append(got)
        history = ids + got["tokens"]
    return results


@pytest.mark.parametrize("mode", list(MODES))
def test_multi_turn_through_two_workers(cluster, reference, mode):
    with WedlmClient(cluster["address"], timeout=120) as client:
        results = _conversation(client, reference, MODES[mode])
    first = len(reference.encode(SYSTEM))
    for got in results[1:]:  # each later turn reuses the previous one's rows
        assert got["cached_tokens"] > first, got


def test_shared_system_prompt_concurrent_questions(cluster, reference):
    params = MODES["ar"]
    system = reference.encode(SYSTEM)
    with WedlmClient(cluster["address"], timeout=120) as client:
        client.generate(ids=system + reference.encode("warm the cache"), params=params)
    jobs = [system + reference.encode(q) for q in QUESTIONS]
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        with WedlmClient(cluster["address"], timeout=120) as client:
            results[i] = client.generate(ids=jobs[i], params=params)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, ids in enumerate(jobs):
        assert results[i]["tokens"] == reference(ids, params)
        assert results[i]["cached_tokens"] >= len(system) - 1
    with WedlmClient(cluster["address"]) as client:
        status = client.status_dict()
    cache = status["prefix_cache"]
    assert cache["enabled"] and int(cache["hits"]) >= len(QUESTIONS)
    assert int(cache["hit_tokens"]) >= len(QUESTIONS) * (len(system) - 1)
    assert "prefix cache:" in format_status(status)
    text = urllib.request.urlopen(cluster["metrics"], timeout=10).read().decode()
    hits = [line for line in text.splitlines() if line.startswith("wedlm:prefix_cache_hits")]
    assert hits and float(hits[0].split()[-1]) >= len(QUESTIONS)
    assert "wedlm:prefix_cache_tokens" in text


def test_openai_usage_reports_cached_prompt_tokens(cluster):
    client = openai.OpenAI(base_url=cluster["http"], api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "what comes after five"},
    ]
    models = client.models.list().data
    first = client.chat.completions.create(model=models[0].id, messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and after six"},
    ]
    second = client.chat.completions.create(model=models[0].id, messages=messages, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens


def test_worker_killed_between_turns_drops_the_cache(model, reference):
    started = _start(model, fixed=False)
    try:
        victim = started["procs"][1]  # the last stage

        def kill() -> None:
            os.kill(victim.popen.pid, signal.SIGKILL)

        with WedlmClient(started["address"], timeout=180) as client:
            results = _conversation(client, reference, MODES["ar"], turns=3, then=kill)
            # the turn after the loss found no cache: it was rebuilt from tokens
            assert results[-1]["cached_tokens"] == 0
            status = client.status_dict()
        assert sum(w["health"] == "serving" for w in status["workers"]) == 1
    finally:
        for p in started["procs"]:
            p.stop()


def test_no_prefix_cache_flag(model, reference):
    started = _start(model, "--no-prefix-cache")
    try:
        with WedlmClient(started["address"], timeout=120) as client:
            results = _conversation(client, reference, MODES["ar"], turns=2)
            assert all(r["cached_tokens"] == 0 for r in results)
            status = client.status_dict()
        assert not status["prefix_cache"].get("enabled")
        assert "prefix cache: off" in format_status(status)
    finally:
        for p in started["procs"]:
            p.stop()


@pytest.mark.parametrize("value", ["-5", "0", "many"])
def test_bad_prefix_cache_budget_is_refused(model, value):
    proc = spawn(
        "coordinator.service.server_cli", "serve", "--model", str(model),
        "--prefix-cache-tokens", value,
    )  # fmt: skip
    code, output = proc.wait_exit()
    assert code == 2 and "--prefix-cache-tokens" in output
