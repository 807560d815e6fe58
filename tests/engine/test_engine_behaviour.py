"""Engine behaviour beyond plain parity: the committed KV, masks in prompts, stops,
max_tokens, mlx-lm equality in AR mode, sampling and request validation."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from common.errors import InvalidRequest
from common.generation_params import GenerationParams
from common.kv_rows import KVRows
from common.model_parts import run_layers
from coordinator.engine.local_engine import open_local_engine
from tests.conftest import shared_model
from tests.support.reference_wedlm import reference_generate


def generate(local, prompt, **kw):
    seq = local.engine.submit(prompt, GenerationParams(**kw))
    for _ in local.engine.stream([seq]):
        pass
    return seq


@pytest.fixture(scope="module")
def qwen3(checkpoint_dir):
    path = checkpoint_dir("wedlm_qwen3", seed=7)
    return path, open_local_engine(path)


def test_committed_kv_equals_a_fresh_prefill(qwen3):
    _, local = qwen3
    prompt = local.tokenizer.encode("the quick brown fox")
    seq = local.engine.submit(prompt, GenerationParams(threshold=1.5, max_tokens=200))
    while len(seq.output) < 30:  # stop mid-generation, while the KV is still held
        local.engine.step()
    history = (prompt + seq.output)[: seq.kv_length]
    assert seq.kv_length > len(prompt) + 10
    store = local.engine.pipeline.runner.store
    # a WeDLM look-ahead forward in flight has had its kept rows named already
    ahead = sum(p.keep for f in local.engine.in_flight for p in f.plans if p.seq is seq)
    assert store.length(seq.seq_id) == seq.kv_length + ahead
    kv = store.rows_for([seq.seq_id])
    fresh = KVRows(len(kv.layers), 1)
    parts = local.engine.parts
    t = len(history)
    run_layers(parts, parts.embed(mx.array([history])), fresh, np.tri(t, dtype=bool)[None])
    for ours, ref in zip(kv.layers, fresh.layers, strict=True):
        np.testing.assert_allclose(
            np.array(ours.keys[0, :, :t]), np.array(ref.keys[0, :, :t]), atol=1e-5
        )
        np.testing.assert_allclose(
            np.array(ours.values[0, :, :t]), np.array(ref.values[0, :, :t]), atol=1e-5
        )
    local.engine.cancel(seq)
    local.engine.step()  # reaps the cancelled sequence and releases its KV
    assert seq.seq_id not in local.engine.pipeline.runner.store


def test_prompt_containing_the_mask_id(qwen3):
    path, local = qwen3
    mask = local.engine.config.mask_token_id
    prompt = [*local.tokenizer.encode("a b"), mask, mask, *local.tokenizer.encode("c")]
    eos = local.engine.config.eos_token_ids
    ref = reference_generate(path, prompt, threshold=1.5, max_tokens=20, stop_ids=eos)
    assert generate(local, prompt, threshold=1.5, max_tokens=20).output == ref["tokens"]


def test_stop_id_in_the_middle_of_a_commit(qwen3):
    path, local = qwen3
    prompt = local.tokenizer.encode("one two three")
    free = reference_generate(path, prompt, threshold=10.0, max_tokens=32)
    tokens = free["tokens"]
    assert free["forwards"] < len(tokens) // 4  # whole windows commit at once
    stop = tokens[5]
    cut = tokens.index(stop) + 1
    ref = reference_generate(path, prompt, threshold=10.0, max_tokens=32, stop_ids=(stop,))
    seq = generate(local, prompt, threshold=10.0, max_tokens=32, stop_ids=(stop,))
    assert seq.output == ref["tokens"] == tokens[:cut]
    assert seq.finish_reason == "stop"


def test_max_tokens_smaller_than_the_window(qwen3):
    path, local = qwen3
    prompt = local.tokenizer.encode("hello")
    seq = generate(local, prompt, window=16, threshold=10.0, max_tokens=3)
    ref = reference_generate(path, prompt, window=16, threshold=10.0, max_tokens=3)
    assert seq.output == ref["tokens"] and len(seq.output) == 3
    assert seq.finish_reason == "length"


def test_stop_string_ends_the_sequence(qwen3):
    _, local = qwen3
    prompt = local.tokenizer.encode("tell me")
    free = generate(local, prompt, mode="ar", max_tokens=30)
    text = local.tokenizer.decode(free.output)
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    assert needle.strip()
    seq = generate(local, prompt, mode="ar", max_tokens=30, stop_strings=(needle,))
    assert seq.finish_reason == "stop"
    assert needle in local.tokenizer.decode(seq.output)
    assert needle not in local.tokenizer.decode(seq.output[:-1])


@pytest.mark.parametrize("model", ["tiny-llama", "stories260K"])
def test_autoregressive_equals_mlx_lm_greedy(checkpoint_dir, model):
    path = checkpoint_dir("llama", seed=8) if model == "tiny-llama" else shared_model(model)
    local = open_local_engine(path)
    prompt = local.tokenizer.encode("Once upon a time")
    seq = local.engine.submit(prompt, GenerationParams(mode="ar", max_tokens=48))
    seq.params = dataclasses.replace(seq.params, extra_stop_ids=())  # mlx-lm ignores EOS here
    for _ in local.engine.stream([seq]):
        pass
    ref_model, _ = mlx_lm_load_model(path)
    ref = [
        int(t)
        for (t, _), _ in zip(generate_step(mx.array(prompt), ref_model), range(48), strict=False)
    ]
    assert seq.output == ref


def test_sampling_is_seeded_and_batch_invariant(checkpoint_dir):
    path = checkpoint_dir("qwen3", seed=9)
    single = open_local_engine(path, num_rows=1)
    batch = open_local_engine(path, num_rows=3)
    prompt = single.tokenizer.encode("sample me")
    kw = dict(threshold=1.0, temperature=0.9, top_p=0.9, top_k=40, max_tokens=24)
    a = generate(single, prompt, seed=1, **kw).output
    assert generate(single, prompt, seed=1, **kw).output == a
    assert generate(single, prompt, seed=2, **kw).output != a
    others = [
        batch.engine.submit(batch.tokenizer.encode("x y z"), GenerationParams(seed=5, **kw)),
        batch.engine.submit(prompt, GenerationParams(seed=1, **kw)),
        batch.engine.submit(prompt, GenerationParams(mode="ar", max_tokens=10)),
    ]
    for _ in batch.engine.stream(others):
        pass
    assert others[1].output == a


def test_top_k_one_is_greedy(qwen3):
    _, local = qwen3
    prompt = local.tokenizer.encode("greedy")
    greedy = generate(local, prompt, threshold=1.0, max_tokens=16).output
    sampled = generate(local, prompt, threshold=1.0, max_tokens=16, temperature=1.5, top_k=1)
    assert sampled.output == greedy


def test_invalid_requests_are_refused(qwen3):
    _, local = qwen3
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        local.engine.submit([], GenerationParams())
    with pytest.raises(InvalidRequest, match="out of range"):
        local.engine.submit([1, 99999], GenerationParams())
    with pytest.raises(InvalidRequest, match="exceeds the model's context of 512"):
        local.engine.submit([1] * 500, GenerationParams(window=16))
    for bad in (
        dict(window=0),
        dict(threshold=-1.0),
        dict(top_p=0.0),
        dict(temperature=-1),
        dict(max_tokens=0),
        dict(mode="beam"),
    ):
        with pytest.raises(InvalidRequest):
            GenerationParams(**bad)
