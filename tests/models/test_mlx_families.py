"""Families served because mlx-lm has them (common/model_families.py): greedy AR tokens of
the single-process engine equal mlx-lm's own `generate_step` (float32), alone, batched
with another request and from the prefix cache. Sliding-window layers see only their
window: the prompts cross it."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.generation_params import GenerationParams
from common.model_parts import load_model_parts
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.prefix_cache import PrefixCache
from tests.support.checkpoints import (
    MLX_FAMILIES,
    REFUSED_FAMILIES,
    SLIDING_WINDOW,
    make_mlx_checkpoint,
    mlx_lm_greedy,
)

FAMILIES = list(MLX_FAMILIES)
# random weights whose greedy tokens repeat one token (a tied head with soft-capping):
# their logits are compared instead (test_logits_match_mlx_lm)
REPEATING = {"gemma2"}
GREEDY = [f for f in FAMILIES if f not in REPEATING]
# batched and prefix-cache runs
MAIN = ["gpt_oss", "gemma3_text", "gemma3", "glm4", "mistral3_ministral3", "gemma4", "llama4"]
PROMPTS = (
    "once upon a time there was a little robot who liked to count",
    "the quick brown fox",
)
MAX_TOKENS = 20
AR = GenerationParams(mode="ar", max_tokens=MAX_TOKENS)
# per family: each layer's window as mlx-lm's make_cache() says (None: full attention)
WINDOWS = {
    "gpt_oss": (SLIDING_WINDOW, None) * 2,
    "gemma3_text": (SLIDING_WINDOW, None) * 2,
    "gemma3": (SLIDING_WINDOW, None) * 2,
    "cohere2": (SLIDING_WINDOW, None) * 2,
    "ministral3": (SLIDING_WINDOW, None) * 2,
    "mistral3_ministral3": (SLIDING_WINDOW, None) * 2,
    "gemma4_text": (SLIDING_WINDOW, None) * 2,
    "gemma4": (SLIDING_WINDOW, None) * 2,
}
# per family: each layer's attention chunk (Llama 4's ChunkedKVCache layers)
CHUNKS = {"llama4": (SLIDING_WINDOW,) * 3 + (None,)}


# a seed whose random weights do not repeat one token (a tied head tends to)
SEEDS = {"cohere2": 4, "gemma4_text": 4}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx-families")
    return {f: make_mlx_checkpoint(root / f, f, seed=SEEDS.get(f, 3)) for f in FAMILIES}


_ENGINES: dict = {}


def engine(path: Path, rows: int = 1, cached: bool = False):
    key = (str(path), rows, cached)
    if key not in _ENGINES:
        cache = PrefixCache(capacity_tokens=100_000) if cached else None
        _ENGINES[key] = open_local_engine(path, num_rows=rows, prefix_cache=cache)
    return _ENGINES[key]


def reference(path: Path, text: str) -> list[int]:
    """mlx-lm's greedy tokens, up to a token the engine stops at (the end tokens its
    tokenizer names too)."""
    local = engine(path)
    prompt = local.tokenizer.encode(text)
    return mlx_lm_greedy(path, prompt, MAX_TOKENS, local.engine.model_stop_ids)


def run(local, prompts: list[list[int]]):
    seqs = [local.engine.submit(p, AR) for p in prompts]
    for _ in local.engine.stream(seqs):
        pass
    return seqs


@pytest.mark.parametrize("family", GREEDY)
def test_one_process_matches_mlx_lm(models, family):
    path = models[family]
    local = engine(path)
    assert local.engine.parts.windows == WINDOWS.get(family, (None,) * 4)
    chunks = tuple(c.chunk for c in local.engine.parts.caches)
    assert chunks == CHUNKS.get(family, (None,) * 4)
    for text in PROMPTS:
        prompt = local.tokenizer.encode(text)
        if text == PROMPTS[0] and (family in WINDOWS or family in CHUNKS):
            assert len(prompt) > SLIDING_WINDOW  # the prompt alone crosses the window
        want = reference(path, text)
        assert len(set(want)) > 2, "degenerate random model: the test would prove little"
        assert run(local, [prompt])[0].output == want, text


@pytest.mark.parametrize("family", MAIN)
def test_two_prompts_batched_give_each_its_solo_tokens(models, family):
    path = models[family]
    local = engine(path, rows=2)
    prompts = [local.tokenizer.encode(t) for t in PROMPTS]
    seqs = run(local, prompts)
    assert [s.output for s in seqs] == [reference(path, t) for t in PROMPTS]


@pytest.mark.parametrize("family", MAIN)
def test_a_repeated_prompt_from_the_prefix_cache(models, family):
    path = models[family]
    local = engine(path, cached=True)
    prompt = local.tokenizer.encode(PROMPTS[0] + " and then some more words to cache")
    want = mlx_lm_greedy(path, prompt, MAX_TOKENS, local.engine.model_stop_ids)
    first = run(local, [prompt])[0]
    again = run(local, [prompt])[0]
    assert again.cached_tokens > SLIDING_WINDOW  # the cached rows cross the window too
    assert first.output == again.output == want


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_mlx_lm(models, family):
    """A prompt past the window at once (the plain causal path: families that apply the
    mask themselves need it as an array), then decode steps: the logits are mlx-lm's."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from common.kv_rows import KVRows
    from common.model_parts import run_layers

    path = models[family]
    parts = load_model_parts(path)
    ref, _ = load_model(path)
    ref.set_dtype(mx.float32)
    cache = make_prompt_cache(ref)
    kv = KVRows(len(parts.layers), 1)
    tokens = mx.array([[5, 17, 99, 3, 250, 7, 42, 8, 301, 11, 64, 2]])
    for _ in range(3):
        t = tokens.shape[1]
        ours = parts.head(run_layers(parts, parts.embed(tokens), kv, np.tri(t, dtype=bool)[None]))
        kv.commit([t])
        theirs = ref(tokens, cache=cache)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)
        tokens = mx.argmax(theirs[:, -1:], axis=-1)


@pytest.mark.parametrize("family", MAIN)
def test_layer_ranges_carry_their_windows(models, family):
    """A stage holding layers 2-3 gets the windows of layers 2-3, not of 0-1."""
    from common.layer_range import LayerRange

    parts = load_model_parts(models[family], LayerRange(1, 3), with_ends=False)
    assert parts.windows == WINDOWS.get(family, (None,) * 4)[1:]
    assert not hasattr(parts, "embed_tokens")


def test_the_window_mask_is_what_makes_them_equal(models, monkeypatch):
    """Without its window's mask a sliding layer sees every position, and the tokens part
    from mlx-lm's: the parity above depends on the window, not on luck."""
    from common.kv_rows import KVRows

    path = models["gpt_oss"]
    want = reference(path, PROMPTS[0])
    monkeypatch.setattr(KVRows, "sliding_mask", lambda self, mask, window, chunk=None: mask)
    local = open_local_engine(path)
    assert run(local, [local.tokenizer.encode(PROMPTS[0])])[0].output != want


def test_the_chunk_mask_is_what_makes_llama4_equal(models, monkeypatch):
    """Without its chunk's mask a chunked layer sees every earlier position: the tokens
    part from mlx-lm's, so the parity above depends on the chunks."""
    from common.kv_rows import KVRows

    path = models["llama4"]
    want = reference(path, PROMPTS[0])
    plain = KVRows.sliding_mask
    monkeypatch.setattr(KVRows, "sliding_mask", lambda self, m, w, c=None: plain(self, m, w))
    local = open_local_engine(path)
    assert run(local, [local.tokenizer.encode(PROMPTS[0])])[0].output != want


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"hidden_size_per_layer_input": 16}, "per-layer input embeddings"),
        ({"num_kv_shared_layers": 2}, "KV-shared layers .num_kv_shared_layers.: later"),
    ],
)
def test_gemma4_layouts_the_stages_cannot_carry_are_refused(fields, why, tmp_path):
    """Gemma 4's small models (E2B/E4B) feed every layer an embedding of its own and share
    KV across layers: refused at load in one line, not served wrong."""
    from common.errors import CheckpointError

    path = make_mlx_checkpoint(tmp_path / "g", "gemma4_text", **fields)
    with pytest.raises(CheckpointError, match=f"config.json: gemma4_text has {why}"):
        load_model_parts(path)


def test_a_quantized_kv_cache_gpt_oss_cannot_use_is_refused_at_the_start(tmp_path):
    """mlx-lm's quantized attention has no attention sinks: with --kv-bits gpt-oss stops
    when its layers are set up, in one line, not at its first request."""
    from common.errors import WedlmError
    from common.kv_format import KVFormat
    from common.layer_runner import LayerRunner

    kv = KVFormat(bits=8, group_size=32)
    parts = load_model_parts(make_mlx_checkpoint(tmp_path / "g", "gpt_oss", head_dim=32))
    with pytest.raises(WedlmError, match=r"gpt_oss cannot keep its KV quantized.*sinks"):
        LayerRunner(parts, kv)
    parts = load_model_parts(make_mlx_checkpoint(tmp_path / "m", "gemma3_text", head_dim=32))
    LayerRunner(parts, kv)  # sliding windows over quantized KV: mlx-lm's quantized path


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text"])
def test_speculative_on_a_sliding_window_family_equals_ar(models, family):
    """Verified drafts (prompt lookup: these checkpoints are not WeDLM-trained) write and
    roll back rows of sliding-window layers in natural order: the tokens stay AR's."""
    path = models[family]
    local = engine(path)
    # lookup finds drafts in the repeated words; the prompt crosses the window
    text = "once upon a time there was a little robot who liked to count once upon a time"
    prompt = local.tokenizer.encode(text)
    spec = GenerationParams(mode="speculative", window=4, max_tokens=MAX_TOKENS)
    seq = local.engine.submit(prompt, spec)
    for _ in local.engine.stream([seq]):
        pass
    want = mlx_lm_greedy(path, prompt, MAX_TOKENS, local.engine.model_stop_ids)
    assert seq.output == want and len(want) == MAX_TOKENS
    assert seq.drafted > 0  # drafts were written, verified and rolled back


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_mode_wedlm_on_a_sliding_window_family_is_refused_with_why(models, family):
    from common.errors import InvalidRequest

    local = engine(models[family])
    prompt = local.tokenizer.encode(PROMPTS[1])
    with pytest.raises(InvalidRequest, match=f"mode wedlm is not served for {family}: it has "):
        local.engine.submit(prompt, GenerationParams(mode="wedlm", max_tokens=4))
    assert local.engine.default_mode == "ar"  # mode auto decodes it with AR


@pytest.mark.parametrize("family", list(REFUSED_FAMILIES))
def test_sparse_attention_families_are_refused_at_load_with_why(family, tmp_path):
    """DeepSeek V3.2 and GLM-5 (DSA): mlx-lm builds them, but each layer's indexer keeps
    keys in a second cache the engine lacks: the start stops in one line naming both."""
    from tests.models.test_family_refusals import assert_refused

    path = make_mlx_checkpoint(tmp_path / family, family, spec=REFUSED_FAMILIES[family])
    assert_refused(
        path,
        f"{family} has sparse attention (DSA: each layer keeps its indexer's keys",
        "cannot serve yet",
        str(path / "config.json"),
    )
