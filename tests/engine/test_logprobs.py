"""Logprobs of committed tokens: in AR and speculative mode they equal the log-softmax of
mlx-lm's own logits for the whole sequence (the chosen token and the top k); in WeDLM mode
each token has the logprob of the forward that filled its slot (greedy: the top one)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine

K = 5


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("qwen3", seed=3)


@pytest.fixture(scope="module")
def local(model):
    return open_local_engine(model, num_rows=2)


def _run(local, prompt, **kw):
    seq = local.engine.submit(prompt, GenerationParams(logprobs=K, max_tokens=16, **kw))
    got = []
    for commit in local.engine.stream([seq]):
        assert commit.logprobs is not None and len(commit.logprobs) == len(commit.tokens)
        got += commit.logprobs
    assert [e.token for e in got] == seq.output
    return seq, got


def _reference(model, prompt, output):
    """[len(output), V] log-softmax of mlx-lm's logits predicting each output token."""
    net, _ = load(str(model))
    ids = mx.array([prompt + output[:-1]])
    logits = net(ids)[0, len(prompt) - 1 :].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.parametrize("mode", ["ar", "speculative"])
def test_logprobs_equal_mlx_lm_log_softmax(model, local, mode):
    prompt = local.tokenizer.encode("once upon a time there was")
    extra = {"draft": "lookup"} if mode == "speculative" else {}
    seq, got = _run(local, prompt, mode=mode, **extra)
    ref = _reference(model, prompt, seq.output)
    for n, entry in enumerate(got):
        assert entry.logprob == pytest.approx(ref[n, entry.token], abs=2e-4)
        top = np.argsort(-ref[n])[:K]
        assert [t for t, _ in entry.top] == top.tolist()
        assert [v for _, v in entry.top] == pytest.approx(ref[n, top].tolist(), abs=2e-4)


def test_sampled_tokens_get_their_own_logprob(model, local):
    prompt = local.tokenizer.encode("the cat sat on")
    seq, got = _run(local, prompt, mode="ar", temperature=1.5, seed=7)
    ref = _reference(model, prompt, seq.output)
    assert [e.logprob for e in got] == pytest.approx(
        [ref[n, t] for n, t in enumerate(seq.output)], abs=2e-4
    )


def test_wedlm_tokens_carry_the_filling_forwards_logprob(local):
    prompt = local.tokenizer.encode("count 1 2 3")
    seq, got = _run(local, prompt, mode="wedlm", window=4, threshold=1.5)
    assert seq.forwards < len(seq.output)  # several tokens per forward
    for entry in got:
        assert entry.logprob <= 0 and len(entry.top) == K
        assert entry.top[0] == (entry.token, pytest.approx(entry.logprob, abs=1e-5))  # greedy


def test_rows_that_do_not_ask_get_none(local):
    prompt = local.tokenizer.encode("hello")
    seqs = [
        local.engine.submit(prompt, GenerationParams(mode="ar", max_tokens=4, logprobs=lp))
        for lp in (None, 0)
    ]
    seen = {0: [], 1: []}
    for commit in local.engine.stream(seqs):
        seen[seqs.index(commit.seq)].append(commit.logprobs)
    assert all(lp is None for lp in seen[0])
    assert all(lp and all(not e.top for e in lp) for lp in seen[1] if lp is not None)
