"""n > 1 through the `openai` package against a real cluster (the coordinator holding
layers 0-1, a worker 2-3, two micro-batches in flight, the prefix cache off so that only
the choices share rows): n = 4 answers what 4 independent requests with seeds seed,
seed + 1, ... answer, greedy and sampled, chat and completions, streamed and not, in AR,
WeDLM and speculative mode, while the prompt is prefilled once (the server's
wedlm:prompt_tokens_computed counter: P + 3 rows for n = 4, not 4 P)."""

from __future__ import annotations

import re
import urllib.request

import openai
import pytest

from tests.support.cluster_harness import cluster_name, start_coordinator, start_worker

MESSAGES = [{"role": "user", "content": "count with me: one two three four five six seven"}]
PROMPT = "once upon a time there was a small robot who liked to count the stars at night"


@pytest.fixture(scope="module")
def cluster(checkpoint_dir):
    model = checkpoint_dir("wedlm_qwen3", seed=33, num_hidden_layers=4)
    name = cluster_name()
    worker, address = start_worker(model, name, "--layers", "2-3", "--no-bonjour")
    procs = [worker]
    try:
        coord, _ = start_coordinator(
            model, name, "--no-bonjour", "--worker", address, "--expect", "1",
            "--layers", "0-1", "--micro-batches", "2", "--http-port", "0", "--no-prefix-cache",
        )  # fmt: skip
        procs.append(coord)
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        coord.expect("serving")
        with openai.OpenAI(base_url=http, api_key="x", max_retries=0, timeout=120) as client:
            yield {"client": client, "http": http, "model": model.name}
    finally:
        for p in procs:
            p.stop()


def _computed(cluster) -> tuple[float, float]:
    """The server's counters: prompt tokens prefilled by a forward, and shared by choices."""
    root = cluster["http"].removesuffix("/v1")
    text = urllib.request.urlopen(f"{root}/metrics", timeout=10).read().decode()

    def value(name: str) -> float:
        return float(re.search(rf"^wedlm:{name}_total (\S+)$", text, re.M).group(1))

    return value("prompt_tokens_computed"), value("prompt_tokens_shared")


def _chat(cluster, **kw):
    kw.setdefault("max_tokens", 12)
    return cluster["client"].chat.completions.create(
        model=cluster["model"], messages=MESSAGES, **kw
    )


@pytest.mark.parametrize("mode", ["ar", "wedlm", "speculative"])
def test_greedy_choices_equal_one_request_and_prefill_once(cluster, mode):
    extra = {"extra_body": {"mode": mode}}
    before = _computed(cluster)
    single = _chat(cluster, **extra)
    after_single = _computed(cluster)
    prompt = single.usage.prompt_tokens
    assert after_single[0] - before[0] == prompt
    whole = _chat(cluster, n=4, **extra)
    after = _computed(cluster)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.message.content for c in whole.choices] == [single.choices[0].message.content] * 4
    assert after[0] - after_single[0] == prompt + 3  # the prompt once, then a row each
    assert after[1] - after_single[1] == 3 * (prompt - 1)
    assert whole.usage.prompt_tokens == prompt
    assert whole.usage.completion_tokens == 4 * single.usage.completion_tokens


@pytest.mark.parametrize("mode", ["ar", "wedlm"])
def test_sampled_choices_equal_independent_requests_with_their_seeds(cluster, mode):
    client = cluster["client"]
    args = {"model": cluster["model"], "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0,
            "extra_body": {"mode": mode}}  # fmt: skip
    alone = [client.completions.create(seed=7 + i, **args).choices[0].text for i in range(4)]
    assert len(set(alone)) > 1  # the seeds differ, and so do the texts
    before = _computed(cluster)
    whole = client.completions.create(seed=7, n=4, **args)
    computed = _computed(cluster)[0] - before[0]
    assert [c.text for c in whole.choices] == alone
    assert computed == whole.usage.prompt_tokens + 3
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(seed=7, n=4, stream=True, **args):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(4)] == alone


def test_streamed_chat_choices_and_a_one_token_answer(cluster):
    single = _chat(cluster, temperature=1.0, seed=21).choices[0].message.content
    texts = {i: "" for i in range(4)}
    for chunk in _chat(cluster, n=4, temperature=1.0, seed=21, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == single
    # every choice ends at its first token: choice 0 finishes with its prefill forward,
    # and its rows stay until the other choices have forked them
    before = _computed(cluster)
    short = _chat(cluster, n=4, max_tokens=1, extra_body={"mode": "ar"})
    assert [c.finish_reason for c in short.choices] == ["length"] * 4
    assert _computed(cluster)[0] - before[0] == short.usage.prompt_tokens + 3
