"""WeDLM's look-ahead (coordinator/engine/wedlm_ahead.py): the next window is built on the
device and launched before the host reads the step back. It must be taken, and change
nothing: the same tokens and forwards as the specification's reference and as the engine
without it, greedy and sampled, one sequence and several. (The committed KV after
look-ahead forwards: test_engine_behaviour.test_committed_kv_equals_a_fresh_prefill.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from common.generation_params import GenerationParams
from common.modes import Mode
from common.window_mask import device_visibility, window_visibility
from coordinator.engine import head_choice
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.look_ahead import LookAhead
from coordinator.engine.modes import wedlm as wedlm_mode
from tests.support.reference_wedlm import reference_generate

TEXTS = ("the cat sat on", "count 1 2 3", "a b c d e", "once upon a time")


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    path = checkpoint_dir("wedlm_qwen3", seed=3)
    return path, open_local_engine(path, num_rows=4)


@pytest.fixture
def ahead_count(monkeypatch):
    """How many look-ahead forwards the engine resolved."""
    count = [0]
    resolve = LookAhead.resolve

    def counted(self, *args):
        count[0] += 1
        return resolve(self, *args)

    monkeypatch.setattr(LookAhead, "resolve", counted)
    return count


def decode(local, prompts, params, serial=False):
    engine = local.engine
    if serial:
        engine.ahead.off.add(Mode.WEDLM)
    try:
        seqs = [engine.submit(p, params) for p in prompts]
        for _ in engine.stream(seqs):
            pass
    finally:
        engine.ahead.off.discard(Mode.WEDLM)
    return [(s.output, s.forwards, s.finish_reason) for s in seqs]


def test_visibility_on_the_device_equals_the_host_rule():
    rng = np.random.default_rng(0)
    filled = rng.random((6, 24)) < 0.5
    filled[0] = True  # all filled: causal
    filled[1] = False  # all masks
    want = np.stack([window_visibility(f) for f in filled])
    np.testing.assert_array_equal(np.array(device_visibility(mx.array(filled))), want)


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


def test_the_step_graphs_run_compiled_for_wedlm_windows_only(model, monkeypatch):
    """WeDLM's look-ahead windows have one width every step: their selection and masks run
    compiled (selection.window_fills, window_mask.compiled_*). A speculative batch's widths
    change with its drafts, and MLX traces a compiled function again for each new shape:
    it runs them eagerly. The outputs are the same either way (test_parity, above)."""
    import common.kv_rows as kv_rows
    from coordinator.engine.step_cost import StepCost

    calls: dict[str, int] = {}

    def counting(name, fn):
        def counted(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)

        monkeypatch.setattr(module_of[name], name, counted)

    module_of = {
        "window_fills": head_choice,
        "compiled_device_visibility": wedlm_mode,
        "compiled_attention_mask": kv_rows,
    }
    for name, module in module_of.items():
        counting(name, getattr(module, name))
    _, local = model
    # drafts priced as free, so that the speculative rows draft on this CPU too
    monkeypatch.setattr(local.engine.scheduler, "step_cost", StepCost({1: 1.0}, online=False))
    prompts = [local.tokenizer.encode(t) for t in TEXTS[:2]]
    speculative = GenerationParams(mode="speculative", draft="mask", window=4, max_tokens=12)
    drafting = local.engine.drafting_batches
    decode(local, prompts[:1], speculative)  # one row: it explores without a probe slot
    assert local.engine.drafting_batches > drafting and calls == {}
    decode(local, prompts, GenerationParams(mode="wedlm", window=4, max_tokens=12))
    assert calls["window_fills"] > 0
    assert calls["compiled_device_visibility"] == calls["compiled_attention_mask"] > 0
