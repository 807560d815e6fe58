"""WeDLM's look-ahead (coordinator/engine/wedlm_ahead.py): the next window is built on the
device and launched before the host reads the step back. It must be taken, and change
nothing: the same tokens and forwards as the specification's reference and as the engine
without it, greedy and sampled, one sequence and several, and the same committed KV."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from common.generation_params import GenerationParams
from common.window_mask import window_visibility
from coordinator.engine import engine as engine_module
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.wedlm_ahead import visibility
from tests.reference_wedlm import reference_generate

TEXTS = ("the cat sat on", "count 1 2 3", "a b c d e", "once upon a time")


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    path = checkpoint_dir("wedlm_qwen3", seed=3)
    return path, open_local_engine(path, num_rows=4)


@pytest.fixture
def ahead_count(monkeypatch):
    """How many look-ahead forwards the engine resolved."""
    count = [0]
    resolve = engine_module.Engine._resolve_ahead

    def counted(self, *args):
        count[0] += 1
        return resolve(self, *args)

    monkeypatch.setattr(engine_module.Engine, "_resolve_ahead", counted)
    return count


def decode(local, prompts, params, serial=False):
    engine = local.engine
    if serial:
        engine._launch_wedlm_ahead = lambda *args: False
    try:
        seqs = [engine.submit(p, params) for p in prompts]
        for _ in engine.stream(seqs):
            pass
    finally:
        engine.__dict__.pop("_launch_wedlm_ahead", None)
    return [(s.output, s.forwards, s.finish_reason) for s in seqs]


def test_visibility_on_the_device_equals_the_host_rule():
    rng = np.random.default_rng(0)
    filled = rng.random((6, 24)) < 0.5
    filled[0] = True  # all filled: causal
    filled[1] = False  # all masks
    want = np.stack([window_visibility(f) for f in filled])
    np.testing.assert_array_equal(np.array(visibility(mx.array(filled))), want)


def test_single_sequence_matches_the_reference(model, ahead_count):
    path, local = model
    eos = local.engine.model_stop_ids
    for text in TEXTS[:2]:
        prompt = local.tokenizer.encode(text)
        kw = dict(window=8, threshold=1.5, penalty=0.02, max_tokens=24)
        ref = reference_generate(path, prompt, stop_ids=eos, **kw)
        [(tokens, forwards, _)] = decode(local, [prompt], GenerationParams(mode="wedlm", **kw))
        assert tokens == ref["tokens"], (text, tokens, ref["tokens"])
        assert forwards == ref["forwards"]
    assert ahead_count[0] > 4  # the look-ahead was taken, not skipped


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("rows", [1, 4])
def test_same_as_without_look_ahead(model, ahead_count, temperature, rows):
    _, local = model
    prompts = [local.tokenizer.encode(t) for t in TEXTS[:rows]]
    params = GenerationParams(
        mode="wedlm", window=8, threshold=1.0, max_tokens=20, temperature=temperature, seed=5
    )
    ahead = decode(local, prompts, params)
    taken = ahead_count[0]
    assert decode(local, prompts, params, serial=True) == ahead
    assert taken > 2 and ahead_count[0] == taken


def test_committed_kv_after_look_ahead_equals_a_fresh_prefill(model, ahead_count):
    from common.kv_rows import KVRows
    from common.model_parts import run_layers

    _, local = model
    prompt = local.tokenizer.encode("the quick brown fox")
    seq = local.engine.submit(prompt, GenerationParams(mode="wedlm", threshold=1.5, max_tokens=200))
    while len(seq.output) < 30:  # stop mid-generation, while the KV is still held
        local.engine.step()
    assert ahead_count[0] > 2
    history = (prompt + seq.output)[: seq.kv_length]
    store = local.engine.pipeline.runner.store
    # the look-ahead forward in flight has had its kept rows named already
    in_flight = sum(p.keep for f in local.engine.in_flight for p in f.plans if p.seq is seq)
    assert store.length(seq.seq_id) == seq.kv_length + in_flight
    kv = store.rows_for([seq.seq_id])
    fresh = KVRows(len(kv.layers), 1)
    parts = local.engine.parts
    t = len(history)
    run_layers(parts, parts.embed(mx.array([history])), fresh, np.tri(t, dtype=bool)[None])
    for ours, ref in zip(kv.layers, fresh.layers, strict=True):
        np.testing.assert_allclose(
            np.array(ours.keys[0, :, :t]), np.array(ref.keys[0, :, :t]), atol=1e-5
        )
    local.engine.cancel(seq)
    local.engine.step()
