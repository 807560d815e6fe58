"""The prefix cache in one process: the index (longest prefix, mid-block divergence, entries
covered by longer ones, LRU eviction, pins), forks in the per-row KV store, and the engine's
greedy tokens with the cache on equal to the cache-off run in AR, WeDLM and speculative
mode, for multi-turn conversations, shared system prompts, strict prefixes, divergence
mid-block and eviction under a tiny budget (real tiny checkpoints, float32)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from common.generation_params import GenerationParams
from common.kv_format import KVFormat
from common.kv_store import KVStore
from common.layer_runner import LayerRunner, RowsError
from common.model_parts import load_model_parts
from common.rows_spec import RowsSpec
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.prefix_cache import BLOCK, PrefixCache

# ---------------------------------------------------------------- the index


def test_index_finds_the_longest_prefix_and_extends_it_past_blocks():
    cache = PrefixCache(capacity_tokens=10_000)
    a = list(range(100, 180))  # 80 tokens: 5 blocks
    b = a[:40] + list(range(500, 540))  # shares 2.5 blocks with a
    cache.insert(1, a, None)
    cache.insert(2, b, None)
    hit = cache.find([*a[:50], 7, 8, 9])
    assert (hit.source, hit.length) == (1, 50)  # diverges mid-block: the agreeing part
    hit = cache.find([*b, 1])
    assert (hit.source, hit.length) == (2, 80)
    hit = cache.find(a[:40] + [9] * 30)
    assert hit.length == 40
    assert cache.find(a).length == 79  # a strict copy leaves its last token to run
    assert cache.find(list(range(1000, 1100))) is None
    assert cache.find([*a[: BLOCK - 1], 1, 2]) is None  # under one block: not worth a copy


def test_index_keeps_one_entry_per_conversation():
    cache = PrefixCache(capacity_tokens=10_000)
    turn1 = list(range(100, 150))
    turn2 = turn1 + list(range(300, 340))
    cache.insert(1, turn1, None)
    cache.insert(2, turn2, None)  # covers turn 1: its rows give way
    assert list(cache.entries) == [2] and cache.tokens == len(turn2)
    assert cache.take_dropped() == [1]
    cache.insert(3, turn1[:30], None)  # covered by the entry there: not kept
    assert list(cache.entries) == [2] and cache.take_dropped() == [3]
    cache.insert(4, list(range(5)), None)  # shorter than a block
    assert cache.take_dropped() == [4]


def test_eviction_is_lru_and_spares_pinned_entries():
    cache = PrefixCache(capacity_tokens=100)
    first, second = list(range(0, 40)), list(range(1000, 1040))
    cache.insert(1, first, None)
    cache.insert(2, second, None)
    hit = cache.find([*first, 5])
    cache.take(hit)  # 1 is now the most recent, and pinned
    cache.insert(3, list(range(2000, 2040)), None)  # 120 tokens > 100: evict the LRU (2)
    assert sorted(cache.entries) == [1, 3] and cache.stats.evictions == 1
    assert cache.take_dropped() == [2]
    assert cache.shrink(0) == 40  # only 3 can go: 1 is pinned
    assert list(cache.entries) == [1]
    cache.unpin(hit)
    cache.unpin(hit)  # a second unpin changes nothing
    assert cache.entries[1].pins == 0
    assert cache.shrink(0) == 40 and not cache.entries
    cache.insert(5, list(range(3000, 3032)), None)
    assert sorted(cache.clear()) == [1, 3, 5] and cache.tokens == 0


def test_capacity_follows_the_kv_budget_unless_fixed():
    assert PrefixCache().capacity(10_000) == 5_000
    assert PrefixCache(capacity_tokens=123).capacity(10_000) == 123
    assert PrefixCache().capacity(None) > 0


# ---------------------------------------------------------------- forks in the KV store


@pytest.fixture(scope="module")
def qwen3(checkpoint_dir):
    return checkpoint_dir("qwen3", seed=61, head_dim=64, num_hidden_layers=3)


def _prefill(runner: LayerRunner, seq_id: int, tokens: list[int], start: int = 0, forks=()):
    t = len(tokens)
    spec = RowsSpec(
        [seq_id], np.array([start]), np.array([t]), np.ones((1, t), bool), np.array([t]),
        forks=list(forks),
    )  # fmt: skip
    hidden = runner.parts.embed(mx.array([tokens]))
    return runner.forward(spec, hidden)


@pytest.mark.parametrize("bits", [None, 8])
def test_a_fork_continues_exactly_like_the_source(qwen3, bits):
    parts = load_model_parts(qwen3)
    runner = LayerRunner(parts, KVFormat(bits))
    prompt = [(5 * i + 3) % parts.config.vocab_size for i in range(40)]
    _prefill(runner, 1, prompt)
    whole = _prefill(runner, 2, [*prompt[:30], 9, 10, 11])  # no cache: from scratch
    part = _prefill(runner, 3, [9, 10, 11], start=30, forks=[(3, 1, 30)])
    np.testing.assert_allclose(np.array(part), np.array(whole[:, 30:]), atol=1e-4)
    assert runner.store.length(1) == 40 and runner.store.length(3) == 33  # the source stays


def test_forks_are_checked_and_survive_their_source(qwen3):
    parts = load_model_parts(qwen3)
    runner = LayerRunner(parts)
    _prefill(runner, 1, list(range(20)))
    with pytest.raises(RowsError, match="not here"):
        _prefill(runner, 2, [1], start=5, forks=[(2, 99, 5)])
    with pytest.raises(RowsError, match="holds 20"):
        _prefill(runner, 2, [1], start=25, forks=[(2, 1, 25)])
    with pytest.raises(RowsError, match="starts at 4"):
        _prefill(runner, 2, [1], start=4, forks=[(2, 1, 5)])
    with pytest.raises(RowsError, match="not in the forward"):
        _prefill(runner, 1, [1], start=20, forks=[(1, 1, 5)])
    _prefill(runner, 3, [1])
    with pytest.raises(RowsError, match="already has KV"):
        _prefill(runner, 3, [1], start=5, forks=[(3, 1, 5)])
    runner.release([3])
    store = runner.store
    store.fork(5, 1, 12)
    assert 5 in store and store.length(5) == 12
    store.release([1])  # the source goes first: the fork's rows are copied out
    assert 1 not in store and store.length(5) == 12
    store.release([5])
    assert len(store) == 0 and not store.batches


def test_kv_store_forks_share_a_gather(qwen3):
    """Two new sequences forking one source in the same forward, next to a running one."""
    parts = load_model_parts(qwen3)
    runner = LayerRunner(parts)
    base = list(range(50, 90))
    _prefill(runner, 1, base)
    _prefill(runner, 7, [3, 4, 5])
    t = 2
    spec = RowsSpec(
        [7, 2, 3], np.array([3, 20, 32]), np.full(3, t), np.ones((3, t), bool), np.full(3, t),
        forks=[(2, 1, 20), (3, 1, 32)],
    )  # fmt: skip
    runner.forward(spec, parts.embed(mx.array([[6, 7], [1, 2], [3, 4]])))
    assert [runner.store.length(s) for s in (1, 2, 3, 7)] == [40, 22, 34, 5]
    assert isinstance(runner.store, KVStore)


# ---------------------------------------------------------------- the engine


def _run(local, prompt: list[int], params: GenerationParams):
    seq = local.engine.submit(prompt, params)
    for _ in local.engine.stream([seq]):
        pass
    local.engine.step()  # reaps it: its rows go to the cache
    return seq


MODES = {
    "ar": GenerationParams(mode="ar", max_tokens=24),
    "wedlm": GenerationParams(threshold=1.0, window=8, max_tokens=24),
    "speculative": GenerationParams(mode="speculative", draft="lookup", window=6, max_tokens=24),
}


@pytest.fixture(scope="module")
def wedlm_model(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen3", seed=62, num_hidden_layers=4)


@pytest.fixture(scope="module")
def engines(wedlm_model):
    plain = open_local_engine(wedlm_model)
    cached = open_local_engine(wedlm_model, prefix_cache=PrefixCache(capacity_tokens=100_000))
    return plain, cached


def _words(local, text: str) -> list[int]:
    return local.tokenizer.encode(text)


@pytest.mark.parametrize("mode", list(MODES))
def test_multi_turn_conversation_equals_the_cache_off_run(engines, mode):
    plain, cached = engines
    params = MODES[mode]
    history = _words(plain, f"<|im_start|>user\nthe quick brown fox {mode} jumps<|im_end|>\n")
    stored = 0
    for turn in range(3):
        prompt = history + _words(plain, f"<|im_start|>user\nturn {turn} asks why<|im_end|>\n")
        want = _run(plain, prompt, params)
        got = _run(cached, prompt, params)
        assert got.output == want.output, (turn, got.output, want.output)
        # every row the previous turn stored (its last commits' rows were never written)
        assert got.cached_tokens >= stored  # (earlier tests may share a first block)
        history, stored = prompt + got.output, got.kv_length
    assert len(cached.engine.prefix_cache.entries) >= 1


def test_shared_system_prompt_strict_prefix_and_mid_block_divergence(engines):
    plain, cached = engines
    system = _words(plain, "<|im_start|>system\nYou are a careful counting robot: one two "
                           "three four five six seven eight nine ten.<|im_end|>\n")  # fmt: skip
    params = GenerationParams(mode="ar", max_tokens=12)
    first = system + _words(plain, "what comes after five")
    second = system + _words(plain, "she sells sea shells")
    prefix = first[: len(system) + 2]  # a strict prefix of a cached prompt
    diverged = first[: len(system) + 3] + _words(plain, "lazy dog")
    for prompt in (first, second, prefix, diverged):
        want = _run(plain, prompt, params)
        got = _run(cached, prompt, params)
        assert got.output == want.output
    stats = cached.engine.prefix_cache.stats
    assert stats.hits >= 3


def test_eviction_under_a_tiny_budget_keeps_outputs_equal(wedlm_model):
    plain = open_local_engine(wedlm_model)
    tiny = open_local_engine(wedlm_model, prefix_cache=PrefixCache(capacity_tokens=2 * BLOCK))
    params = GenerationParams(mode="ar", max_tokens=10)
    prompts = [_words(plain, f"prompt number {i} " * 3) for i in range(4)]
    for prompt in prompts + prompts[::-1]:
        assert _run(tiny, prompt, params).output == _run(plain, prompt, params).output
    cache = tiny.engine.prefix_cache
    assert cache.stats.evictions > 0 and cache.tokens <= 2 * BLOCK
    held = tiny.engine.pipeline.runner.store
    assert len(held) == len(cache.entries)  # evicted rows were released


def test_cached_kv_counts_against_admission(wedlm_model):
    """A request that needs the room the cache holds evicts it instead of waiting."""
    local = open_local_engine(wedlm_model, num_rows=2, prefix_cache=PrefixCache())
    params = GenerationParams(mode="ar", max_tokens=8)
    prompt = _words(local, "the quick brown fox jumps over the lazy dog " * 2)
    first = _run(local, prompt, params)
    cache = local.engine.prefix_cache
    held = cache.tokens
    assert held > 0
    other = _words(local, "she sells sea shells by the sea shore " * 2)
    needs = (len(other) + 8 + 1) + (len(other) - 1 + 8 + 1)  # prompt, max_tokens, one row
    local.engine.scheduler.limits.kv_tokens = needs + held - 1
    a = local.engine.submit(other, params)
    b = local.engine.submit(other[:-1], params)
    local.engine.step()
    assert len(local.engine.running) == 2  # both admitted: the cache made room
    assert cache.stats.evictions == 1 and not cache.entries
    for _ in local.engine.stream([a, b]):
        pass
    assert first.output


def test_recovery_drops_the_cache(engines):
    _, cached = engines
    engine = cached.engine
    _run(cached, _words(cached, "a long enough prompt to be cached here, twice over"), MODES["ar"])
    assert engine.prefix_cache.entries
    engine.restart_on(engine.pipeline)
    assert not engine.prefix_cache.entries
    assert len(engine.pipeline.runner.store) == 0
