"""Prompt logprobs (params.prompt_logprobs, completions' echo): each prompt token after the
first gets the log-softmax of mlx-lm's own logits at the row before it, with its top k,
whatever the prompt's chunking, the decoding mode or a prefix cache holding its rows."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from common.errors import InvalidRequest
from common.generation_params import GenerationParams
from common.model_parts import load_model_parts
from common.tokenizer import Tokenizer
from coordinator.engine.engine_for import engine_for
from coordinator.engine.limits import Limits
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.pipeline import LocalPipeline
from coordinator.engine.prefix_cache import PrefixCache
from coordinator.engine.token_logprobs import PromptLogprob

K = 3


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("qwen3", seed=5)


@pytest.fixture(scope="module")
def reference(model):
    net, _ = load(str(model))

    def logprobs(prompt: list[int]) -> np.ndarray:
        """[len(prompt) - 1, V]: row n predicts prompt[n + 1]."""
        logits = net(mx.array([prompt]))[0, :-1].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return logprobs


def _engine(model, chunk: int = 512, cache: PrefixCache | None = None):
    parts = load_model_parts(str(model))
    tokenizer = Tokenizer(str(model))
    limits = replace(Limits(), prefill_chunk=chunk)
    engine = engine_for(
        parts, LocalPipeline(parts), 4, tokenizer.decode, tokenizer.stop_ids,
        limits=limits, prefix_cache=cache,
    )  # fmt: skip
    return engine, tokenizer


def _prompt_entries(engine, seqs) -> dict[int, list]:
    got: dict[int, list] = {s.seq_id: [] for s in seqs}
    for commit in engine.stream(seqs):
        got[commit.seq.seq_id] += [e for e in commit.logprobs or () if isinstance(e, PromptLogprob)]
    return got


def _check(entries: list, prompt: list[int], ref: np.ndarray) -> None:
    assert [e.token for e in entries] == prompt[1:]
    for n, e in enumerate(entries):
        assert e.logprob == pytest.approx(ref[n, prompt[n + 1]], abs=2e-4)
        top = np.argsort(-ref[n])[:K]
        assert [t for t, _ in e.top] == top.tolist()
        assert [v for _, v in e.top] == pytest.approx(ref[n, top].tolist(), abs=2e-4)


@pytest.mark.parametrize("chunk", [512, 8])  # one forward, and chunks of 8 rows (padded)
@pytest.mark.parametrize("mode", ["ar", "wedlm", "speculative"])
def test_prompt_logprobs_equal_mlx_lm_log_softmax(model, reference, chunk, mode):
    engine, tokenizer = _engine(model, chunk)
    prompts = [
        tokenizer.encode("the quick brown fox jumps over the lazy dog and runs far away"),
        tokenizer.encode("one two three"),
    ]
    params = GenerationParams(mode=mode, max_tokens=3, logprobs=K, prompt_logprobs=True)
    seqs = [engine.submit(p, params) for p in prompts]
    seqs.append(engine.submit(prompts[1], replace(params, prompt_logprobs=False)))
    got = _prompt_entries(engine, seqs)
    for seq, prompt in zip(seqs, prompts, strict=False):
        _check(got[seq.seq_id], prompt, reference(prompt))
    assert got[seqs[2].seq_id] == []  # a row that does not ask, in the same batch


def test_a_cached_prefix_does_not_skip_scored_rows(model, reference):
    engine, tokenizer = _engine(model, cache=PrefixCache(capacity_tokens=10_000))
    prompt = tokenizer.encode("a prefix that the cache will hold for the next request")
    plain = GenerationParams(mode="ar", max_tokens=2)
    list(engine.stream([engine.submit(prompt, plain)]))
    seq = engine.submit(prompt, replace(plain, logprobs=K, prompt_logprobs=True))
    got = _prompt_entries(engine, [seq])
    assert seq.cached_tokens == 0
    _check(got[seq.seq_id], prompt, reference(prompt))


def test_prompt_logprobs_need_logprobs():
    with pytest.raises(InvalidRequest, match="prompt logprobs need logprobs"):
        GenerationParams(prompt_logprobs=True)


def test_generated_tokens_keep_their_logprobs(model):
    local = open_local_engine(model)
    prompt = local.tokenizer.encode("hello there")
    params = GenerationParams(mode="ar", max_tokens=4, logprobs=K)
    plain = local.engine.submit(prompt, params)
    asked = [e for c in local.engine.stream([plain]) for e in c.logprobs]
    seq = local.engine.submit(prompt, replace(params, prompt_logprobs=True))
    echoed = [e for c in local.engine.stream([seq]) for e in c.logprobs]
    assert len(echoed) == len(prompt) - 1 + len(asked)
    assert echoed[len(prompt) - 1 :] == asked
