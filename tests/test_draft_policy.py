"""The cost-aware draft policy (draft_policy.py) with given break-evens, the break-even's
bookkeeping (step_cost.py), and its measurement on a real engine (step_timing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from common.generation_params import GenerationParams
from coordinator.engine.draft_policy import (
    PROBE_EVERY,
    PROBE_MAX,
    adapt_draft_limit,
    draft_room,
    drafts_off,
)
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Sequence
from coordinator.engine.step_cost import AR, DRAFT, ONLINE_MIN, StepCost


def new_seq(window: int = 8) -> Sequence:
    return Sequence(0, [1], GenerationParams(mode="speculative", window=window))


def forward(seq: Sequence, drafted: int, accepted: int, break_even: float, extra: int = -1):
    """One verifying forward's outcome, as apply_result counts it."""
    seq.forwards += 1
    adapt_draft_limit(seq, drafted, accepted, break_even, extra)


def ar_until_probe(seq: Sequence, break_even: float) -> int:
    """AR forwards (one row) until the next one is a probe; how many ran."""
    n = 0
    while draft_room(seq) == 0:
        forward(seq, 0, 0, break_even, extra=0)
        n += 1
    return n


@pytest.mark.parametrize(("break_even", "drafting"), [(1.05, True), (2.0, False)])
def test_one_and_a_half_tokens_per_forward(break_even, drafting):
    """One draft accepted, then a forward whose mask slots drafted nothing: 1.5 tokens per
    drafting forward pays at a break-even of 1.05, not at 2.0."""
    seq = new_seq()
    seq.draft_limit = 1
    for _ in range(10):
        forward(seq, 1, 1, break_even)  # 2 tokens
        if not drafting:
            break
        forward(seq, 0, 0, break_even, extra=3)  # mask slots only: 1 token
        assert draft_room(seq) > 0
    assert (draft_room(seq) > 0) is drafting
    if drafting:
        assert 1.3 < seq.draft_state.gain < 1.7


def test_two_and_a_half_tokens_per_forward_pays_at_two():
    seq = new_seq()
    seq.draft_limit = 2
    for _ in range(10):
        forward(seq, 2, 2, 2.0)  # 3 tokens
        forward(seq, 2, 1, 2.0)  # 2 tokens (half accepted: the limit stays)
        assert draft_room(seq) > 0
    assert 2.2 < seq.draft_state.gain < 2.8


def test_probes_back_off_while_they_fail():
    """Drafts off after a forward that gained nothing; probes then come after 8, 16, 32, ...
    forwards up to PROBE_MAX, and the request decodes as AR in between."""
    seq = new_seq()
    forward(seq, 8, 0, 1.5)
    assert seq.draft_limit == 0 and draft_room(seq) == 0
    gaps = []
    for _ in range(7):
        gaps.append(ar_until_probe(seq, 1.5) + 1)  # the probe is the gap's last forward
        assert draft_room(seq) == 1
        forward(seq, 1, 0, 1.5)  # the probe's draft is rejected
        assert seq.draft_limit == 0
    assert gaps == [PROBE_EVERY, 16, 32, 64, PROBE_MAX, PROBE_MAX, PROBE_MAX]


def test_a_probe_that_pays_resets_the_back_off():
    seq = new_seq()
    forward(seq, 8, 0, 1.5)
    for _ in range(3):  # gaps 8, 16, 32
        ar_until_probe(seq, 1.5)
        forward(seq, 1, 0, 1.5)
    assert seq.draft_state.gap == 64
    ar_until_probe(seq, 1.5)
    forward(seq, 1, 1, 1.5)  # accepted: drafting resumes, judged afresh
    assert seq.draft_limit == 2 and seq.draft_state.gain is None
    forward(seq, 2, 2, 1.5)  # 3 tokens: paid
    forward(seq, 4, 0, 1.5)  # none accepted: off again
    assert seq.draft_limit == 0
    assert ar_until_probe(seq, 1.5) + 1 == PROBE_EVERY


def test_a_resumed_spell_that_never_pays_keeps_backing_off():
    """At a break-even of 3, a probe's accepted draft resumes drafting, but 2 tokens per
    forward never pay: the gap keeps doubling."""
    seq = new_seq()
    forward(seq, 8, 0, 3.0)
    ar_until_probe(seq, 3.0)
    forward(seq, 1, 1, 3.0)
    assert seq.draft_limit == 2
    forward(seq, 2, 1, 3.0)  # 2 tokens: gain 2 <= 3
    assert seq.draft_limit == 0
    assert ar_until_probe(seq, 3.0) + 1 == 2 * PROBE_EVERY


def test_a_mask_probe_verifies_its_confident_slot_next():
    """With mask drafts a probe first runs mask slots; when one is confident, the next
    forward verifies it (also a probe), and drafts_off knows neither is an AR forward."""
    seq = new_seq()
    forward(seq, 8, 0, 1.5)
    ar_until_probe(seq, 1.5)
    seq.drafts = np.array([5], np.int32)  # what the probe's mask slots drafted
    forward(seq, 0, 0, 1.5, extra=2)
    assert draft_room(seq) == 1
    one_row = RowPlan(seq, np.zeros(1, np.int32), np.ones(1, bool), 1, np.zeros(1), np.ones(1))
    assert not drafts_off(one_row)
    seq.drafts = np.zeros(0, np.int32)
    forward(seq, 1, 0, 1.5, extra=3)  # rejected: off, the gap doubled
    assert draft_room(seq) == 0 and drafts_off(one_row)
    assert ar_until_probe(seq, 1.5) + 1 == 2 * PROBE_EVERY


def test_step_cost_seeds_refines_and_falls_back():
    cost = StepCost()
    assert cost.break_even(1) == 1.0  # nothing measured: drafts pay when anything is taken
    cost.seed({1: 2.4, 8: 1.3})
    assert cost.break_even(1) == 2.4
    assert cost.break_even(5) == 1.3 and cost.break_even(32) == 1.3  # the nearest below
    cost.seed({2: 0.9})
    assert cost.break_even(2) == 1.0  # never below one AR forward
    for _ in range(ONLINE_MIN):
        cost.observe(AR, 1, 0.004)
        cost.observe(DRAFT, 1, 0.006)
    assert cost.break_even(1) == pytest.approx(1.5)
    assert cost.describe()[1] == pytest.approx(1.5)


def test_measured_break_even_seeds_the_engine_and_changes_no_token(checkpoint_dir):
    """measure_step_cost times real forwards of a tiny WeDLM checkpoint; then, with a
    break-even no draft can reach, a speculative request decodes mostly as AR and its
    output is still AR's."""
    from coordinator.engine.local_engine import open_local_engine
    from coordinator.engine.step_timing import measure_step_cost

    local = open_local_engine(checkpoint_dir("wedlm_qwen3", seed=81), num_rows=2)
    engine = local.engine
    ratios = measure_step_cost(engine, repeats=2, rounds=1)
    assert set(ratios) == {1, 2} and all(r > 0 for r in ratios.values())
    assert engine.step_cost.describe().keys() == {1, 2}
    prompt = local.tokenizer.encode("count 1 2 3 1 2 3 1 2")

    def run(params):
        seq = engine.submit(prompt, params)
        for _ in engine.stream([seq]):
            pass
        return seq

    ar = run(GenerationParams(mode="ar", max_tokens=40))
    engine.step_cost.online = False
    engine.step_cost.seed({1: 50.0})
    sp = run(GenerationParams(mode="speculative", draft="mask", window=8, max_tokens=40))
    assert sp.output == ar.output
    assert sp.forwards + sp.accepted == len(sp.output)
    # drafts off after the first forward; probes at most every 8 forwards after it
    assert sp.drafted <= 8 + sp.forwards // PROBE_EVERY + 1


def test_drafts_that_cannot_pay_are_never_tried():
    """A forward commits at most window + 1 tokens: at a break-even of at least that (a
    CPU whose multi-row forwards cost 10x a one-row one), the request decodes as AR from
    its first forward, with no probes, and every forward may be AR's look-ahead."""
    seq = new_seq(window=4)
    assert draft_room(seq, 4.9) == 4 and draft_room(seq, 5.0) == 0
    one_row = RowPlan(seq, np.zeros(1, np.int32), np.ones(1, bool), 1, np.zeros(1), np.ones(1))
    for _ in range(3 * PROBE_EVERY):
        assert drafts_off(one_row, 5.0)
        forward(seq, 0, 0, 5.0, extra=0)
        assert draft_room(seq, 5.0) == 0
