"""n > 1 choices of one request prefill their prompt once (prompt_sharing.py): on the
single-process engine, choices that fork the first choice's prompt rows give the tokens
of independent requests in every mode, greedy and sampled; a first choice that ends at
its first token still gives its rows, one cancelled before its prompt ran lets the others
prefill alone, and its rows are released once every fork has run."""

from __future__ import annotations

import pytest

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine

PROMPT = "the quick brown fox jumps over the lazy dog, and then it runs far away"


@pytest.fixture(scope="module")
def local(checkpoint_dir):
    return open_local_engine(checkpoint_dir("wedlm_qwen3", seed=7), num_rows=8)


def _params(mode: str, temperature: float, max_tokens: int = 16) -> list[GenerationParams]:
    return [
        GenerationParams(mode=mode, max_tokens=max_tokens, temperature=temperature, seed=3 + i)
        for i in range(4)
    ]


def _alone(local, prompt: list[int], params: list[GenerationParams]) -> list[list[int]]:
    outputs = []
    for p in params:
        seq = local.engine.submit(prompt, p)
        for _ in local.engine.stream([seq]):
            pass
        outputs.append(seq.output)
    return outputs


def _shared(local, prompt: list[int], params: list[GenerationParams], cancel_first=False):
    engine = local.engine
    first = engine.submit(prompt, params[0])
    if cancel_first:
        engine.cancel(first)
    others = [engine.submit(prompt, p, shares_with=first) for p in params[1:]]
    for _ in engine.stream(others if cancel_first else [first, *others]):
        pass
    while engine.has_work:  # reap them all: the rows they held are released
        engine.step()
    return first, others


@pytest.mark.parametrize("mode", ["ar", "wedlm", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choices_fork_the_prompt_once(local, mode, temperature):
    prompt = local.tokenizer.encode(PROMPT)
    params = _params(mode, temperature)
    alone = _alone(local, prompt, params)
    first, others = _shared(local, prompt, params)
    assert [first.output] + [s.output for s in others] == alone
    assert first.prefilled - first.cached_tokens == len(prompt)  # the prompt, once
    for seq in others:
        assert seq.shared_tokens == seq.cached_tokens == len(prompt) - 1
        assert seq.prefilled - seq.cached_tokens == 1  # its last token: its own logits
    store = local.engine.pipeline.runner.store
    assert not any(s.seq_id in store for s in [first, *others])


def test_a_first_choice_ending_at_its_first_token_still_shares(local):
    prompt = local.tokenizer.encode(PROMPT)
    params = _params("ar", 1.0)
    params[0] = GenerationParams(mode="ar", max_tokens=1, temperature=1.0, seed=3)
    alone = _alone(local, prompt, params)
    first, others = _shared(local, prompt, params)
    assert len(first.output) == 1
    assert [first.output] + [s.output for s in others] == alone
    assert [s.shared_tokens for s in others] == [len(prompt) - 1] * 3


def test_a_cancelled_first_choice_lets_the_others_prefill_alone(local):
    prompt = local.tokenizer.encode(PROMPT)
    params = _params("wedlm", 0.0)
    alone = _alone(local, prompt, params)
    first, others = _shared(local, prompt, params, cancel_first=True)
    assert first.finish_reason == "cancelled"
    assert [s.output for s in others] == alone[1:]
    assert [s.shared_tokens for s in others] == [0, 0, 0]
    assert all(s.prefilled == len(prompt) and not s.cached_tokens for s in others)


def test_a_different_prompt_is_never_shared(local):
    prompt = local.tokenizer.encode(PROMPT)
    first = local.engine.submit(prompt, GenerationParams(mode="ar", max_tokens=2))
    other = local.engine.submit(prompt[:-1], GenerationParams(mode="ar", max_tokens=2),
                                shares_with=first)  # fmt: skip
    assert other.share_from is None
    for _ in local.engine.stream([first, other]):
        pass


def test_choices_share_with_the_prefix_cache_on(checkpoint_dir):
    from coordinator.engine.prefix_cache import PrefixCache

    local = open_local_engine(checkpoint_dir("wedlm_qwen3", seed=7), num_rows=8,
                              prefix_cache=PrefixCache())  # fmt: skip
    prompt = local.tokenizer.encode(PROMPT)
    params = _params("ar", 1.0)
    first, others = _shared(local, prompt, params)  # nothing cached yet: choice 0 prefills
    assert first.cached_tokens == 0
    assert [s.shared_tokens for s in others] == [len(prompt) - 1] * 3
    again, more = _shared(local, prompt, params)  # choice 0 hits the cache, the rest fork it
    assert again.cached_tokens == len(prompt) - 1
    assert [s.shared_tokens for s in more] == [len(prompt) - 1] * 3
    assert [again.output] + [s.output for s in more] == [first.output] + [
        s.output for s in others
    ]
    cache = local.engine.scheduler.prefix_cache()
    assert all(e.pins == 0 for e in cache.entries.values())
