"""The prompt's last chunk opens decoding (row_plan.plan_opening): a WeDLM request's first
window, and a speculative request's first mask slots, ride the prompt's forward instead of
a forward of their own. Real engines on tiny real checkpoints; outputs stay the spec
reference's (WeDLM) and AR's (speculative), token for token."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.modes import PlanContext, apply_result, plan_prefill
from coordinator.engine.sequence import Phase, Sequence
from tests.support.reference_wedlm import reference_generate


def _prefill(seq, chunk, mask=None, positions=0, break_even=1.0):
    """plan_prefill with the engine's context (none: the diffusion scheduler's call)."""
    ctx = None if mask is None else PlanContext(mask, positions, chunk, break_even)
    return plan_prefill(seq, chunk, ctx)

MASK = 7


@pytest.fixture(scope="module")
def wedlm(checkpoint_dir):
    return open_local_engine(checkpoint_dir("wedlm_qwen3", seed=82), num_rows=4)


def _run(local, prompt: list[int], params: GenerationParams) -> tuple[Sequence, list]:
    """One request through the engine; each completed forward's (phase, plans) as it ran."""
    engine = local.engine
    ran, complete = [], engine._complete

    def spy(commits):
        done = complete(commits)
        if done is not None:
            plans = done.flight.plans
            ran.append([(p.seq.phase, p.opens, p.width, p.keep, p.drafts) for p in plans])
        return done

    engine._complete = spy
    try:
        seq = engine.submit(prompt, params)
        for _ in engine.stream([seq]):
            pass
    finally:
        del engine._complete
    return seq, ran


def test_wedlm_first_window_rides_the_prompt_and_keeps_parity(wedlm):
    """The prompt's forward carries the W masks of step 1: the request runs as many
    forwards as the reference has steps (the prompt's included), and the same tokens."""
    prompt = wedlm.tokenizer.encode("count 1 2 3 1 2 3")
    params = GenerationParams(mode="wedlm", window=8, threshold=1.5, max_tokens=24)
    stop = wedlm.engine.config.eos_token_ids
    ref = reference_generate(
        wedlm.engine.parts.config.path, prompt, window=8, threshold=1.5, penalty=params.penalty,
        max_tokens=24, stop_ids=stop,
    )  # fmt: skip
    seq, ran = _run(wedlm, prompt, params)
    assert seq.output == ref["tokens"]
    assert seq.forwards == ref["forwards"] == len(ran)
    first = ran[0][0]
    assert first[:4] == (Phase.PREFILL, True, len(prompt) + 8, len(prompt))


def test_wedlm_without_room_in_the_chunk_runs_step_one_apart(wedlm):
    """A last chunk with no room for the window (here: exactly a full chunk) is the
    prompt alone; step 1 then runs as its own forward, and the output is the same."""
    engine = wedlm.engine
    prompt = wedlm.tokenizer.encode("the cat sat on the mat and the dog")
    params = GenerationParams(mode="wedlm", window=8, threshold=1.5, max_tokens=16)
    opened, ran_opened = _run(wedlm, prompt, params)
    limits = engine.scheduler.limits
    engine.scheduler.limits = replace(limits, prefill_chunk=len(prompt))
    try:
        apart, ran_apart = _run(wedlm, prompt, params)
    finally:
        engine.scheduler.limits = limits
    assert apart.output == opened.output
    assert not any(opens for row in ran_apart for _, opens, *_ in row)
    assert len(ran_apart) == len(ran_opened) + 1  # the prompt's forward, then step 1


def test_speculative_first_drafts_come_from_the_prompts_forward(wedlm):
    """Speculative with mask drafts: the prompt's last row chooses the first token and its
    mask slots draft the next ones, so the first decode forward verifies drafts. The
    output is AR's token for token, greedy and sampled."""
    prompt = wedlm.tokenizer.encode("count 1 2 3 1 2 3 1 2")
    for sampling in ({}, {"temperature": 0.8, "seed": 5}):
        ar, _ = _run(wedlm, prompt, GenerationParams(mode="ar", max_tokens=24, **sampling))
        spec = GenerationParams(mode="speculative", draft="mask", window=8, max_tokens=24,
                                **sampling)  # fmt: skip
        seq, ran = _run(wedlm, prompt, spec)
        assert seq.output == ar.output
        phase, opens, width, keep, _ = ran[0][0]
        assert (phase, opens, keep) == (Phase.PREFILL, True, len(prompt)) and width > keep
    # greedy, this prompt: the prompt's forward found confident slots (seen in the run)
    greedy, ran = _run(wedlm, prompt, replace(spec, temperature=0.0, seed=0))
    assert ran[1][0][0] is Phase.DECODE and ran[1][0][4] > 0  # it verifies drafts at once
    assert greedy.draft_forwards >= 1  # the prompt's forward is not counted as one


def _seq(mode: str, prompt: int = 10, **kw) -> Sequence:
    params = GenerationParams(mode=mode, max_tokens=32, **kw)
    seq = Sequence(seq_id=1, prompt=list(range(100, 100 + prompt)), params=params)
    seq.phase = Phase.PREFILL
    return seq


def test_which_last_chunks_open_decoding():
    """plan_prefill: only the prompt's last chunk opens, only for WeDLM and for mask drafts
    of a new request, and only where the slots fit the chunk and the context."""
    wedlm = _prefill(_seq("wedlm", window=4), 64, MASK, 4096)
    assert wedlm.opens and wedlm.keep == 10 and wedlm.width == 14
    assert list(wedlm.head_slots) == [10, 11, 12, 13] and wedlm.head_is_mask.all()
    assert list(wedlm.tokens[10:]) == [MASK] * 4 and not wedlm.filled[10:].any()
    spec = _prefill(_seq("speculative", draft="mask", window=4), 64, MASK, 4096)
    assert spec.opens and spec.keep == 10 and spec.drafts == 0
    assert list(spec.head_slots) == [9, 10, 11, 12, 13]  # the first token's row, then masks
    assert list(spec.head_is_mask) == [False, True, True, True, True]
    not_opening = [
        _prefill(_seq("ar"), 64, MASK, 4096),
        _prefill(_seq("speculative", draft="lookup", window=4), 64, MASK, 4096),
        _prefill(_seq("wedlm", window=4), 12, MASK, 4096),  # 10 + 4 > a chunk of 12
        _prefill(_seq("wedlm", window=4), 64, MASK, 13),  # past the context
        _prefill(_seq("wedlm", prompt=80, window=4), 64, MASK, 4096),  # not the last
        _prefill(_seq("wedlm", window=4), 64),  # no mask id: diffusion's scheduler
    ]
    assert not any(p.opens for p in not_opening)
    assert not_opening[0].width == 10 and list(not_opening[0].head_slots) == [9]
    drafting = _seq("speculative", draft="mask", window=4)
    drafting.draft_limit = 2  # a state it carries already: not a new request's opening
    assert not _prefill(drafting, 64, MASK, 4096).opens
    done = _seq("speculative", draft="mask", window=4)
    done.prefilled = done.kv_length = 10  # no prompt row left: no row to choose from
    assert not _prefill(done, 64, MASK, 4096).opens
    rebuilt = _seq("wedlm", window=4)
    rebuilt.rebuild_to, rebuilt.output = 12, [1, 2, 3]
    assert not _prefill(rebuilt, 64, MASK, 4096).opens
    never_pays = _seq("speculative", draft="mask", window=4)  # break-even past window + 1
    assert not _prefill(never_pays, 64, MASK, 4096, break_even=9.0).opens


def test_an_opening_without_confident_slots_halves_the_draft_limit():
    """The prompt's mask slots are the request's first exploration: none confident halves
    its limit as a decode forward's would (draft_policy.adapt_draft_limit)."""
    seq = _seq("speculative", draft="mask", window=8)
    plan = _prefill(seq, 64, MASK, 4096)
    k = plan.head_slots.size
    _, phase = apply_result(plan, np.zeros(k, bool), np.arange(k) + 50)
    assert phase is Phase.DECODE and seq.output == [50] and seq.draft_limit == 4
    assert seq.drafts.size == 0 and seq.forwards == 1 and seq.draft_forwards == 0
