"""Speculative mode in one process: every draft source gives exactly the autoregressive
tokens (greedy and sampled, dense and MoE, batched with other requests), its samples follow
AR's distribution, and drafts that cross a stop or the token limit change nothing."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import numpy as np
import pytest

from common.errors import CheckpointError, InvalidRequest
from common.generation_params import GenerationParams
from coordinator.engine.draft_model import DraftModel
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.prompt_lookup import prompt_lookup
from tests.conftest import shared_model

TEXTS = ["the cat sat on the mat and the cat sat on", "count 1 2 3 1 2 3 1 2", "a b c a b"]
FAMILIES = ["wedlm_qwen3", "llama", "qwen3_moe"]


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    """family -> LocalEngine with 8 rows, and a draft model of another family (same
    tokenizer) loaded on it."""
    out = {}
    for family in FAMILIES:
        local = open_local_engine(checkpoint_dir(family, seed=71), num_rows=8)
        other = checkpoint_dir("llama" if family != "llama" else "qwen3", seed=72)
        local.engine.use_drafter(DraftModel.load(other, local.engine.config, local.tokenizer))
        out[family] = local
    return out


def run_all(local, jobs: list[tuple[list[int], GenerationParams]]):
    """Submit every job at once (they share forwards) and run them to the end."""
    seqs = [local.engine.submit(prompt, params) for prompt, params in jobs]
    for _ in local.engine.stream(seqs):
        pass
    return seqs


def prompts(local) -> list[list[int]]:
    return [local.tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_draft_source_gives_the_autoregressive_tokens(engines, family, temperature):
    """Drafts from mask slots, prompt lookup and the draft model, in one batch with WeDLM
    and AR rows: each speculative row equals the AR run of its prompt and seed."""
    local = engines[family]
    sampling = dict(temperature=temperature, top_k=20 if temperature else 0, top_p=0.95)
    ar_jobs = [(p, GenerationParams(mode="ar", max_tokens=28, seed=5 + i, **sampling))
               for i, p in enumerate(prompts(local))]  # fmt: skip
    expected = [s.output for s in run_all(local, ar_jobs)]
    jobs, want = [], []
    for (prompt, ar), out in zip(ar_jobs, expected, strict=True):
        for draft, window, threshold in (("mask", 8, 2.0), ("lookup", 6, 0.4), ("model", 4, 0.4)):
            params = GenerationParams(mode="speculative", draft=draft, window=window,
                                      threshold=threshold, max_tokens=28, seed=ar.seed,
                                      **sampling)  # fmt: skip
            jobs.append((prompt, params))
            want.append(out)
    jobs.append((prompts(local)[0], GenerationParams(threshold=1.0, max_tokens=20)))  # WeDLM
    seqs = run_all(local, jobs)
    for seq, out in zip(seqs, want, strict=False):
        assert seq.output == out, (seq.params.draft, seq.output, out)
        assert seq.forwards + seq.accepted == len(seq.output)  # each forward: accepted + 1
    assert sum(s.drafted for s in seqs) > 0


def test_a_draft_model_equal_to_the_served_one_is_always_accepted(checkpoint_dir):
    """Greedy drafts of the model itself are its own choices: every draft is accepted and a
    forward commits window + 1 tokens."""
    path = checkpoint_dir("qwen3", seed=73)
    local = open_local_engine(path, num_rows=4)
    local.engine.use_drafter(DraftModel.load(path, local.engine.config, local.tokenizer))
    params = GenerationParams(mode="speculative", window=4, max_tokens=31)
    assert local.engine.resolve_drafts(params).draft == "model"  # auto prefers the model
    (seq,) = run_all(local, [(prompts(local)[1], params)])
    (ar,) = run_all(local, [(prompts(local)[1], GenerationParams(mode="ar", max_tokens=31))])
    assert seq.output == ar.output
    if seq.finish_reason == "length":
        assert seq.accepted == seq.drafted > 0
        assert seq.forwards == 1 + math.ceil((31 - 1) / 5)  # the first token: prefill's


def test_drafts_that_cross_a_stop_or_the_limit(engines):
    """A stop id inside the accepted drafts ends the output at it, as in AR; so does
    max_tokens, and drafts are never longer than what may still be committed."""
    local = engines["llama"]
    prompt = local.tokenizer.encode("a b a b a b a b a b a b")
    (ar,) = run_all(local, [(prompt, GenerationParams(mode="ar", max_tokens=24))])
    stop = ar.output[6]
    cut = ar.output.index(stop) + 1
    for draft in ("lookup", "model", "mask"):
        for kw, want in ((dict(stop_ids=(stop,), max_tokens=24), ar.output[:cut]),
                         (dict(max_tokens=5), ar.output[:5]),
                         (dict(max_tokens=1), ar.output[:1])):  # fmt: skip
            params = GenerationParams(mode="speculative", draft=draft, window=8, **kw)
            (seq,) = run_all(local, [(prompt, params)])
            assert seq.output == want, (draft, kw)
            assert seq.drafted <= max(len(want) - 1, 0) * 8


def test_prompt_lookup():
    h = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 4, 1, 2, 3])
    assert prompt_lookup(h, 3).tolist() == [4, 1, 2]  # the latest earlier match of 1 2 3
    assert prompt_lookup(np.array([1, 2, 3, 7, 2, 3]), 2).tolist() == [7, 2]
    assert prompt_lookup(np.array([1, 2, 3]), 4).size == 0  # nothing to continue
    assert prompt_lookup(np.array([4]), 4).size == 0
    assert prompt_lookup(h, 0).size == 0


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_sampled_tokens_follow_the_autoregressive_distribution(checkpoint_dir):
    """Independent seeds: the second and third sampled tokens (the first verified ones)
    of 1,200 speculative runs against 1,200 AR runs, a two-sample chi-square test per
    position at the 0.1% level. Drafts come from a different model, so both the accept and
    the reject branch of the rule are exercised."""
    path = checkpoint_dir("qwen3", seed=74)
    local = open_local_engine(path, num_rows=64)
    local.engine.use_drafter(DraftModel.load(path, local.engine.config, local.tokenizer))
    prompt = local.tokenizer.encode("count 1 2 3")
    n = 1200
    sampling = dict(temperature=1.0, top_k=6, max_tokens=3)

    def draws(mode: str, first_seed: int):
        jobs = [(prompt, GenerationParams(mode=mode, seed=first_seed + i, **sampling))
                for i in range(n)]  # fmt: skip
        seqs = []
        for start in range(0, n, 64):
            seqs += run_all(local, jobs[start : start + 64])
        return seqs

    spec = draws("speculative", 10_000)
    ar = draws("ar", 50_000)
    accepted = sum(s.accepted for s in spec)
    assert 0 < accepted < sum(s.drafted for s in spec)  # both branches ran
    for index in (1, 2):
        a = Counter(tuple(s.output[: index + 1]) for s in spec if len(s.output) > index)
        b = Counter(tuple(s.output[: index + 1]) for s in ar if len(s.output) > index)
        cells = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
        rest = (
            sum(a.values()) - sum(a[k] for k in cells),
            sum(b.values()) - sum(b[k] for k in cells),
        )
        rows = [(a[k], b[k]) for k in cells] + ([rest] if sum(rest) else [])
        na, nb = sum(r[0] for r in rows), sum(r[1] for r in rows)
        stat = sum(
            (x * math.sqrt(nb / na) - y * math.sqrt(na / nb)) ** 2 / (x + y) for x, y in rows
        )
        assert len(rows) >= 4, "the test needs several outcomes to mean anything"
        assert stat < _chi2_critical(len(rows) - 1), (index, stat, len(rows))


def test_the_same_seed_samples_the_same_text(engines):
    """Noise is keyed by output index, so a speculative run is AR's run, not only its
    distribution: checked at a high temperature where drafts are often rejected."""
    local = engines["wedlm_qwen3"]
    prompt = prompts(local)[0]
    for seed in range(6):
        kw = dict(temperature=1.3, seed=seed, max_tokens=16)
        (ar,) = run_all(local, [(prompt, GenerationParams(mode="ar", **kw))])
        (sp,) = run_all(
            local, [(prompt, GenerationParams(mode="speculative", draft="model", **kw))]
        )
        assert sp.output == ar.output


def test_bad_draft_settings_are_refused(checkpoint_dir, engines, tmp_path):
    plain = tmp_path / "plain"  # a checkpoint whose config names no mask token
    shutil.copytree(checkpoint_dir("llama", seed=75), plain)
    config = json.loads((plain / "config.json").read_text())
    del config["mask_token_id"]
    del config["wedlm"]  # nor a WeDLM training record
    (plain / "config.json").write_text(json.dumps(config))
    local = open_local_engine(plain)
    prompt = [5, 6, 7]
    with pytest.raises(InvalidRequest, match="--draft-model"):
        local.engine.submit(prompt, GenerationParams(mode="speculative", draft="model"))
    with pytest.raises(InvalidRequest, match="applies to mode speculative only"):
        GenerationParams(mode="ar", draft="lookup")
    with pytest.raises(InvalidRequest, match="draft must be one of"):
        GenerationParams(mode="speculative", draft="ngram")
    # not a WeDLM checkpoint: auto drafts by prompt lookup
    assert local.engine.resolve_drafts(GenerationParams(mode="speculative")).draft == "lookup"
    wedlm = engines["wedlm_qwen3"].engine
    wedlm_alone = open_local_engine(wedlm.config.path)
    auto = wedlm_alone.engine.resolve_drafts(GenerationParams(mode="speculative"))
    assert auto.draft == "mask"
    other_vocab = checkpoint_dir("llama", seed=76, vocab_size=384)
    with pytest.raises(CheckpointError, match="another tokenizer"):
        DraftModel.load(other_vocab, local.engine.config, local.tokenizer)


def test_mask_drafts_on_the_wedlm_trained_checkpoint():
    """The WeDLM-adapted SmolLM2 (round 2): mask-slot drafts give its AR output exactly and,
    on counting, accept drafts (it commits more than one token per forward)."""
    path = shared_model("wedlm-smollm2-135m-r2")
    local = open_local_engine(path, num_rows=2)
    prompt = local.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,")
    (ar,) = run_all(local, [(prompt, GenerationParams(mode="ar", max_tokens=24))])
    params = GenerationParams(
        mode="speculative", draft="mask", window=8, threshold=1.5, max_tokens=24
    )
    (sp,) = run_all(local, [(prompt, params)])
    assert sp.output == ar.output
    assert sp.accepted > 0 and len(sp.output) / sp.forwards > 1.3


def test_mask_drafts_chained_on_the_device_give_the_autoregressive_tokens():
    """speculative_ahead.py: a drafting spell's next forward built on the device from the
    step's choices (accepted run, its guesses) before the read-back. Two rows at once,
    greedy and sampled: the outputs are AR's, as without the look-ahead."""
    path = shared_model("wedlm-smollm2-135m-r2")
    local = open_local_engine(path, num_rows=2)
    engine = local.engine
    engine.speculative_ahead = True
    engine.step_cost.online = False
    engine.step_cost.seed({1: 1.0, 2: 1.0})  # drafts pay whenever one is accepted
    texts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "10, 20, 30, 40, 50, 60, 70,"]
    prompts = [local.tokenizer.encode(t) for t in texts]
    for temperature in (0.0, 0.7):
        sampling = dict(max_tokens=20, temperature=temperature, seed=5)
        ar = run_all(local, [(p, GenerationParams(mode="ar", **sampling)) for p in prompts])
        spec = GenerationParams(mode="speculative", draft="mask", window=8, **sampling)
        chained = engine.speculative_chained
        sp = run_all(local, [(p, spec) for p in prompts])
        assert [s.output for s in sp] == [s.output for s in ar]
        assert engine.speculative_chained > chained and sum(s.accepted for s in sp) > 0


def test_a_forward_with_no_drafts_commits_the_models_choice(engines):
    """An empty draft (nothing to look up) is one pending row and no masks: it decides as
    AR does; the plan never drafts past max_tokens."""
    from coordinator.engine.modes.speculative import plan_speculative

    local = engines["llama"]
    prompt = local.tokenizer.encode("xyz")  # no repeated n-gram: lookup finds nothing
    params = GenerationParams(mode="speculative", draft="lookup", max_tokens=12)
    (ar,) = run_all(local, [(prompt, GenerationParams(mode="ar", max_tokens=12))])
    (seq,) = run_all(local, [(prompt, params)])
    assert seq.output == ar.output
    seq.output, seq.kv_length = seq.output[:3], len(prompt) + 2
    plan = plan_speculative(seq, 0, 4096, "lookup")
    assert plan.keep == 1 and plan.drafts <= 12 - 3 - 1
    assert plan.head_slots.tolist() == list(range(plan.drafts + 1))


def test_drafts_adapt_to_their_acceptance(engines, monkeypatch):
    """Drafts that are never accepted (a draft model that is another random model) are cut
    to none within a few forwards, probed again now and then, and meanwhile the request
    decodes as AR with AR's look-ahead; the output stays AR's token for token."""
    from coordinator.engine import engine as engine_module
    from coordinator.engine.draft_state import PROBE_EVERY

    local = engines["llama"]
    ahead = [0]
    launch = engine_module.Engine._launch_ahead

    def counted(self, flight, fills, tokens):
        taken = launch(self, flight, fills, tokens)
        ahead[0] += taken and flight.plans[0].seq.params.mode == "speculative"
        return taken

    monkeypatch.setattr(engine_module.Engine, "_launch_ahead", counted)
    prompt = local.tokenizer.encode("xyz uvw")
    n = 40
    (ar,) = run_all(local, [(prompt, GenerationParams(mode="ar", max_tokens=n))])
    params = GenerationParams(mode="speculative", draft="model", window=8, max_tokens=n)
    (seq,) = run_all(local, [(prompt, params)])
    assert seq.output == ar.output
    assert seq.accepted == 0  # the random draft model agrees nowhere on this prompt
    assert seq.draft_limit == 0
    probes = seq.forwards // PROBE_EVERY + 1
    assert seq.drafted <= 8 + probes  # cut to none after the first forward, then probes
    assert ahead[0] > seq.forwards // 2  # decoding as AR, with AR's look-ahead


def test_drafts_grow_back_when_accepted():
    from coordinator.engine.draft_policy import adapt_draft_limit, draft_room
    from coordinator.engine.draft_state import PROBE_EVERY
    from coordinator.engine.sequence import Sequence

    seq = Sequence(0, [1], GenerationParams(mode="speculative", window=8))
    assert draft_room(seq) == 8
    adapt_draft_limit(seq, 8, 1)
    assert seq.draft_limit == 1
    adapt_draft_limit(seq, 1, 1)
    adapt_draft_limit(seq, 2, 2)
    assert seq.draft_limit == 4
    adapt_draft_limit(seq, 4, 4)
    adapt_draft_limit(seq, 8, 8)
    assert seq.draft_limit == 8  # never past the window
    adapt_draft_limit(seq, 8, 0)
    assert seq.draft_limit == 0 and draft_room(seq) == 0
    seq.forwards = PROBE_EVERY - 1  # the next forward is a probe
    assert draft_room(seq) == 1
