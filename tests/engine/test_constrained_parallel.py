"""Grammar-constrained decoding keeps the parallel modes' commits (constrained.py): the
output matches the grammar in WeDLM and speculative mode, speculative output is
constrained AR's token for token, a grammar that forbids nothing leaves WeDLM decoding
unchanged, and a WeDLM-trained model still commits several tokens per forward."""

from __future__ import annotations

import contextlib
import json
import random
import re

import jsonschema
import llguidance
import pytest

from common.generation_params import GenerationParams
from common.modes import Mode
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.modes import mode_of
from coordinator.http_api.response_format import JSON_OPTIONS
from tests.conftest import shared_model
from tests.support.checkpoints import TOOL_CHAT_TEMPLATE

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
WORDS = ["cat", "sky", "river", "piano", "seven", "orange", "cloud", "table", "quiet", "north"]


@pytest.fixture(scope="module")
def local(checkpoint_dir):
    path = checkpoint_dir("wedlm_qwen2", seed=5, chat_template=TOOL_CHAT_TEMPLATE,
                          max_position_embeddings=2048)  # fmt: skip
    return open_local_engine(path, num_rows=8)


def _run(local, prompts, **kw):
    engine = local.engine
    seqs = [engine.submit(p, GenerationParams(**kw)) for p in prompts]
    for _ in engine.stream(seqs):
        pass
    return seqs


def _json(local, seq):
    text = re.sub(r"<\|[a-z_]+\|>$", "", local.tokenizer.decode(seq.output))
    return json.loads(text)


def _prompts(local, count, seed):
    rng = random.Random(seed)
    return [local.tokenizer.encode(" ".join(rng.choices(WORDS, k=4))) for _ in range(count)]


GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)


@pytest.mark.parametrize("draft", ["mask", "lookup"])
def test_constrained_speculative_is_constrained_ar(local, draft):
    prompts = _prompts(local, 4, draft)
    for temperature in (0.0, 1.0):  # sampled too: drafts are keyed by the output index
        kw = {"max_tokens": 80, "grammar": GRAMMAR, "temperature": temperature, "seed": 3}
        ar = _run(local, prompts, mode="ar", **kw)
        spec = _run(local, prompts, mode="speculative", draft=draft, **kw)
        for a, s in zip(ar, spec, strict=True):
            assert s.output == a.output and s.finish_reason == "stop"
            jsonschema.validate(_json(local, s), SCHEMA)


def test_constrained_wedlm_output_validates(local):
    prompts = _prompts(local, 8, "wedlm")
    for temperature in (0.0, 1.0):
        seqs = _run(local, prompts, mode="wedlm", grammar=GRAMMAR, max_tokens=120,
                    temperature=temperature, seed=5)  # fmt: skip
        for seq in seqs:
            assert seq.params.mode == "wedlm" and seq.finish_reason == "stop"
            jsonschema.validate(_json(local, seq), SCHEMA)


@pytest.fixture(scope="module")
def trained():
    return open_local_engine(shared_model("wedlm-smollm2-135m-r2"))


COUNTING = dict(max_tokens=48, mode="wedlm", temperature=0.0, threshold=0.6)


def _counting(trained):
    return trained.tokenizer.encode(", ".join(str(i) for i in range(1, 25)) + ",")


def test_a_grammar_that_forbids_nothing_leaves_wedlm_unchanged(trained):
    """The grammar of 'the free output, then anything': every slot the free decoding
    chose is allowed, so the constrained run fills and commits the same tokens in the
    same forwards."""
    prompt = _counting(trained)
    (free,) = _run(trained, [prompt], **COUNTING)
    text = trained.tokenizer.decode(free.output)
    grammar = llguidance.LLMatcher.grammar_from_regex(re.escape(text) + r"(?s:.*)")
    (seq,) = _run(trained, [prompt], grammar=grammar, **COUNTING)
    assert seq.output == free.output and seq.forwards == free.forwards


def test_constrained_wedlm_commits_several_tokens_per_forward(trained):
    """On the WeDLM-trained checkpoint, counting under a grammar of counting."""
    grammar = llguidance.LLMatcher.grammar_from_regex(r" (\d+, )+\d+")
    (seq,) = _run(trained, [_counting(trained)], grammar=grammar, **COUNTING)
    assert re.fullmatch(r" (\d+, )+\d*,? ?", trained.tokenizer.decode(seq.output))
    assert len(seq.output) / seq.forwards > 2, (len(seq.output), seq.forwards)


@contextlib.contextmanager
def _switched(engine, name: str, value: bool):
    """The engine's switch `name` set to `value` for the block (restored after)."""
    old = getattr(engine, name)
    setattr(engine, name, value)
    try:
        yield
    finally:
        setattr(engine, name, old)


def _spy(monkeypatch, obj, name: str) -> list:
    """Record what obj.name returns (and still run it)."""
    calls = []
    inner = getattr(obj, name)

    def spy(*args):
        calls.append(inner(*args))
        return calls[-1]

    monkeypatch.setattr(obj, name, spy)
    return calls


@pytest.mark.parametrize("mode", ["ar", "speculative", "wedlm"])
def test_masks_filled_ahead_equal_inline(local, monkeypatch, mode):
    """The engine fills a forward's masks on the grammars' thread as soon as its matchers
    are advanced (engine._start_fill; an AR look-ahead's matchers take their tokens on that
    thread too, before postprocess: engine._fill_early); the tokens are those of the fill
    done inline, and no forward falls back to the inline fill."""
    from coordinator.engine import constrained

    inline_calls = []
    serial = constrained.mask_logits
    monkeypatch.setattr(constrained, "mask_logits", lambda *a: inline_calls.append(1) or serial(*a))
    early = _spy(monkeypatch, constrained, "take_and_fill")  # AR: before postprocess
    prompts = _prompts(local, 6, f"ahead-{mode}")
    kw = {"mode": mode, "grammar": GRAMMAR, "max_tokens": 60, "seed": 7}
    for temperature in (0.0, 1.0):
        with _switched(local.engine, "fill_ahead", True):
            ahead = _run(local, prompts, temperature=temperature, **kw)
        assert not inline_calls and bool(early) == (mode == "ar")
        with _switched(local.engine, "fill_ahead", False):
            inline = _run(local, prompts, temperature=temperature, **kw)
        assert inline_calls  # the inline path ran
        inline_calls.clear()
        assert [s.output for s in ahead] == [s.output for s in inline]
        for seq in ahead:
            jsonschema.validate(_json(local, seq), SCHEMA)


def test_apply_masks_expands_each_slots_bits():
    """apply_masks against numpy's unpacking of the same table (a vocabulary that is not a
    multiple of 32, slots naming various table rows)."""
    import mlx.core as mx
    import numpy as np

    from coordinator.engine.constrained import Masks, apply_masks

    rng = np.random.default_rng(0)
    v = 70
    table = rng.integers(-(2**31), 2**31, size=(4, 3), dtype=np.int64).astype(np.int32)
    index = rng.integers(0, 4, size=(3, 2)).astype(np.int32)
    logits = rng.standard_normal((3, 2, v)).astype(np.float32)
    out = np.array(apply_masks(Masks(table, index), mx.array(logits)))
    bits = np.unpackbits(table.view(np.uint8), bitorder="little").reshape(4, -1)[:, :v]
    allowed = bits[index].astype(bool)
    assert np.array_equal(out, np.where(allowed, logits, -np.inf))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_wedlm_ahead_equals_serial(local, monkeypatch, temperature):
    """Constrained WeDLM rows are launched ahead (modes/wedlm.py launch_ahead); where the
    grammar then cuts a run that forward was built from, it is dropped and launched again
    (look_ahead.drop). Tokens and forwards equal those of never launching them ahead."""
    engine = local.engine
    launched = _spy(monkeypatch, mode_of(Mode.WEDLM), "launch_ahead")
    dropped = _spy(monkeypatch, engine.ahead, "drop")
    prompts = _prompts(local, 6, f"wedlm-ahead-{temperature}")
    kw = {"mode": "wedlm", "grammar": GRAMMAR, "max_tokens": 80, "seed": 9}
    with _switched(engine, "constrained_ahead", True):
        ahead = _run(local, prompts, temperature=temperature, **kw)
    assert any(launched) and dropped  # both paths ran
    with _switched(engine, "constrained_ahead", False):
        serial = _run(local, prompts, temperature=temperature, **kw)
    assert [s.output for s in ahead] == [s.output for s in serial]
    assert [s.forwards for s in ahead] == [s.forwards for s in serial]
    for seq in ahead:
        jsonschema.validate(_json(local, seq), SCHEMA)


def test_constrained_wedlm_ahead_keeps_parallel_commits(trained, monkeypatch):
    """On the WeDLM-trained checkpoint counting under a grammar of counting, the look-ahead
    runs and the output and forwards are those without it."""
    launched = _spy(monkeypatch, mode_of(Mode.WEDLM), "launch_ahead")
    grammar = llguidance.LLMatcher.grammar_from_regex(r" (\d+, )+\d+")
    with _switched(trained.engine, "constrained_ahead", True):
        (ahead,) = _run(trained, [_counting(trained)], grammar=grammar, **COUNTING)
    assert sum(forward is not None for forward in launched) > 1
    with _switched(trained.engine, "constrained_ahead", False):
        (serial,) = _run(trained, [_counting(trained)], grammar=grammar, **COUNTING)
    assert (ahead.output, ahead.forwards) == (serial.output, serial.forwards)
