"""The engine's WeDLM and AR decoding equal an independent PyTorch reference of the spec,
token for token (float32, greedy), across model families and decoding settings."""

from __future__ import annotations

import pytest

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from tests.support.reference_wedlm import reference_generate

FAMILIES = ["wedlm_qwen3", "wedlm_qwen2", "qwen3", "qwen2", "llama", "qwen3_moe"]
# (window, threshold, penalty): one-by-one, the default, several slots, whole windows.
SETTINGS = [
    (1, 0.4, 0.02),
    (4, None, 0.1),
    (4, 1.5, 0.02),
    (16, 0.4, 0.02),
    (16, None, 0.02),
    (16, 1.5, 0.1),
    (16, 10.0, 0.02),
]
_ENGINES: dict = {}


def engine_for(path, rows: int = 1):
    key = (str(path), rows)
    if key not in _ENGINES:
        _ENGINES[key] = open_local_engine(path, num_rows=rows)
    return _ENGINES[key]


def eos(path) -> tuple[int, ...]:
    return engine_for(path).engine.config.eos_token_ids


def run(path, prompt, **kw):
    local = engine_for(path)
    seq = local.engine.submit(prompt, GenerationParams(**kw))
    for _ in local.engine.stream([seq]):
        pass
    return seq


def prompt_of(path, text: str) -> list[int]:
    return engine_for(path).tokenizer.encode(text)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("window", "threshold", "penalty"), SETTINGS)
def test_wedlm_matches_reference(checkpoint_dir, family, window, threshold, penalty):
    path = checkpoint_dir(family)
    for text in ("the cat sat on", "count 1 2 3"):
        prompt = prompt_of(path, text)
        kw = dict(window=window, threshold=threshold, penalty=penalty, max_tokens=24)
        ref = reference_generate(path, prompt, stop_ids=eos(path), **kw)
        seq = run(path, prompt, **kw)
        assert seq.output == ref["tokens"], (text, seq.output, ref["tokens"])
        assert seq.forwards == ref["forwards"]


@pytest.mark.parametrize("family", FAMILIES)
def test_autoregressive_matches_reference(checkpoint_dir, family):
    path = checkpoint_dir(family, seed=1)
    prompt = prompt_of(path, "once upon a time")
    ref = reference_generate(path, prompt, mode="ar", max_tokens=20, stop_ids=eos(path))
    seq = run(path, prompt, mode="ar", max_tokens=20)
    assert seq.output == ref["tokens"]


def test_high_threshold_commits_several_tokens_per_forward(checkpoint_dir):
    path = checkpoint_dir("wedlm_qwen3")
    seq = run(path, prompt_of(path, "abc"), threshold=10.0, max_tokens=32)
    assert len(seq.output) / seq.forwards > 4


def test_batched_rows_match_reference_each(checkpoint_dir):
    """Four sequences with different prompts and settings share every forward: per-row
    lengths, windows and commit counts must not leak between rows."""
    path = checkpoint_dir("wedlm_qwen3", seed=2)
    local = engine_for(path, rows=4)
    cases = [
        ("the cat", dict(window=16, threshold=1.5, penalty=0.02)),
        ("a much longer prompt about dogs and cats", dict(window=4, threshold=None)),
        ("zz", dict(window=8, threshold=10.0)),
        ("hello world", dict(mode="ar")),
    ]
    seqs, refs = [], []
    for text, kw in cases:
        prompt = local.tokenizer.encode(text)
        seqs.append(local.engine.submit(prompt, GenerationParams(max_tokens=20, **kw)))
        refs.append(reference_generate(path, prompt, max_tokens=20, stop_ids=eos(path), **kw))
    for _ in local.engine.stream(seqs):
        pass
    for seq, ref in zip(seqs, refs, strict=True):
        assert seq.output == ref["tokens"]
