"""The cost-aware draft policy (draft_policy.py) with given break-evens, the break-even's
bookkeeping (step_cost.py), and its measurement on a real engine (step_timing.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from common.generation_params import GenerationParams
from coordinator.engine.draft_policy import (
    adapt_draft_limit,
    batch_rooms,
    draft_room,
    settle_shadow,
)
from coordinator.engine.draft_state import PROBE_EVERY, PROBE_MAX
from coordinator.engine.modes.ar import next_plans
from coordinator.engine.modes.speculative import (
    plan_speculative,
    probe_ends,
    unchanged_by_postprocess,
)
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Phase, Sequence
from coordinator.engine.step_cost import AR, DRAFT, ONLINE_MIN, StepCost


def new_seq(window: int = 8, draft: str = "auto") -> Sequence:
    return Sequence(0, [1], GenerationParams(mode="speculative", window=window, draft=draft))


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


def test_mask_slots_that_draft_nothing_can_turn_drafts_off():
    """A spell whose gain a forward of mask slots (nothing confident, one token) pulls to
    the break-even turns its drafts off, with probes; it is not left with a limit its
    gain can never use (a one-row batch would then hold it back for good)."""
    seq = new_seq(draft="mask")
    seq.forwards, seq.draft_limit = 3, 4
    forward(seq, 2, 1, 1.5, extra=5)  # 2 tokens: the gain starts at 2
    assert seq.draft_limit > 0
    forward(seq, 0, 0, 1.5, extra=3)  # 1 token: 0.3 * 1 + 0.7 * 2 = 1.7
    assert seq.draft_limit > 0 and batch_rooms([seq], 1.5) != [0]
    forward(seq, 0, 0, 1.5, extra=3)  # 1.49
    assert seq.draft_limit == 0 and batch_rooms([seq], 1.5) == [0]
    assert ar_until_probe(seq, 1.5) + 1 == PROBE_EVERY


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


def mask_probe(seq: Sequence, guess: int | None, break_even: float = 1.5) -> None:
    """A mask probe's forward, as apply_result runs it: `guess` is what its confident slot
    drafted for the position after the token it commits (None: nothing confident)."""
    seq.forwards += 1
    seq.drafts = np.array([] if guess is None else [guess], np.int32)
    adapt_draft_limit(seq, 0, 0, break_even, extra_rows=2)
    seq.output.append(7)  # the token it commits


def one_row(seq: Sequence, token: int, break_even: float = 1.5) -> None:
    """A one-row forward committing `token`, as accept_speculative runs it."""
    seq.forwards += 1
    settle_shadow(seq, [token])
    adapt_draft_limit(seq, 0, 0, break_even, extra_rows=0)
    seq.output.append(token)


@pytest.mark.parametrize("right", [True, False])
def test_a_mask_probe_is_checked_by_the_next_token(right):
    """With mask drafts a probe is one forward of mask slots; its confident slot's guess is
    not verified by a drafting forward: the next forward runs one row, and the token it
    commits at the guessed position settles the probe as the verification would (right:
    drafting resumes, judged afresh; wrong: the gap doubles)."""
    seq = new_seq(draft="mask")
    forward(seq, 8, 0, 1.5)
    ar_until_probe(seq, 1.5)
    mask_probe(seq, guess=5)
    assert seq.draft_state.shadow == (len(seq.output), 5) and seq.drafts.size == 0
    assert draft_room(seq) == 0 and batch_rooms([seq], 1.5) == [0]
    one_row(seq, 5 if right else 6)
    assert seq.draft_state.shadow is None
    if right:
        assert seq.draft_limit == 2 and seq.draft_state.gain is None
        one_row(seq, 9)  # a one-row forward says nothing of the drafts: the limit stays
        assert draft_room(seq) == 2
    else:
        assert seq.draft_limit == 0
        assert ar_until_probe(seq, 1.5) + 1 == 2 * PROBE_EVERY


def test_a_mask_probe_with_nothing_confident_backs_off_at_once():
    seq = new_seq(draft="mask")
    forward(seq, 8, 0, 1.5)
    ar_until_probe(seq, 1.5)
    mask_probe(seq, guess=None)
    assert seq.draft_state.shadow is None
    assert ar_until_probe(seq, 1.5) + 1 == 2 * PROBE_EVERY


def test_a_mask_probe_rides_the_look_ahead():
    """modes/ar.py's next_plans: the forward after a one-row forward is planned before it is
    read back. When it is due, a mask probe is: the token of t (a placeholder, fed from
    the device), then mask slots; the forward after the probe is one row again, with no
    second probe. Lookup drafts need t's token on the host: no plan ahead."""
    mask = 99
    seq = new_seq(draft="mask")
    seq.phase, seq.output, seq.kv_length = Phase.DECODE, [3], 1
    forward(seq, 8, 0, 1.5)
    while draft_room(seq, 1.5, ahead=1) == 0:
        forward(seq, 0, 0, 1.5, extra=0)
    row = plan_speculative(seq, mask, 4096, "mask", 1.5, room=0)
    (probe,) = next_plans([row], 1.5, mask, 4096)
    assert probe.width == 3 and probe.keep == 1 and probe.drafts == 0 and not probe.held
    assert probe.tokens[1:].tolist() == [mask, mask] and probe.filled.tolist() == [1, 0, 0]
    assert probe.head_slots.tolist() == [0, 1, 2] and probe.head_is_mask.tolist() == [0, 1, 1]
    assert probe_ends(probe)
    (after,) = next_plans([probe], 1.5, mask, 4096)
    assert after.width == 1 and not after.head_is_mask.any()
    lookup = Sequence(1, [1], GenerationParams(mode="speculative", draft="lookup"))
    lookup.phase, lookup.output, lookup.kv_length = Phase.DECODE, [3], 1
    lookup.draft_limit = 0
    row = plan_speculative(lookup, mask, 4096, "lookup", 1.5, room=0)
    assert next_plans([row], 1.5, mask, 4096) is None


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


def test_a_slow_first_drafting_forward_does_not_price_drafts_out():
    """One drafting forward that compiles a new shape (a second) among 6 ms ones: the
    online figure is a median, so it stays 1.5 (an average seeded by the outlier priced
    drafts at 175 AR forwards on an H100, and no drafting forward came after to fix it)."""
    cost = StepCost()
    cost.observe(DRAFT, 1, 1.0)
    for _ in range(ONLINE_MIN):
        cost.observe(AR, 1, 0.004)
        cost.observe(DRAFT, 1, 0.006)
    assert cost.break_even(1) == pytest.approx(1.5)


def test_a_pricing_budget_measures_the_small_buckets_and_prices_the_rest_from_them(
    checkpoint_dir,
):
    """With no time to spare (budget 0), measure_step_cost times the one-row bucket only,
    and every larger bucket takes its ratio, so a slow backend's startup is not held for
    every bucket of a decode group (the README's local cluster on 2 CPU cores)."""
    from coordinator.engine.local_engine import open_local_engine
    from coordinator.engine.step_timing import measure_step_cost

    local = open_local_engine(checkpoint_dir("wedlm_qwen3", seed=82), num_rows=8)
    engine = local.engine
    ratios = measure_step_cost(engine, repeats=1, rounds=1, budget_s=0.0)
    assert list(ratios) == [1]
    one = max(1.0, ratios[1])
    assert [engine.step_cost.break_even(r) for r in (1, 2, 5, 8)] == [pytest.approx(one)] * 4
    assert not engine.in_flight


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
        assert unchanged_by_postprocess(one_row, 5.0)
        assert batch_rooms([seq], 5.0, ahead=1) == [0]
        forward(seq, 0, 0, 5.0, extra=0)
        assert draft_room(seq, 5.0) == 0


def drafting(gain: float, limit: int = 4) -> Sequence:
    """A speculative request in a drafting spell with this gain."""
    seq = new_seq()
    seq.draft_limit, seq.draft_state.gain = limit, gain
    return seq


def drafts_off_for_now() -> Sequence:
    seq = new_seq()
    seq.draft_limit, seq.draft_state.next_probe = 0, 10**9
    return seq


@pytest.mark.parametrize(("break_even", "drafts"), [(1.5, False), (1.3, True)])
def test_the_batch_drafts_only_when_its_rows_together_pay(break_even, drafts):
    """One row commits 4 tokens per drafting forward, 7 rows' drafts are off: a drafting
    forward of the 8 commits 11 tokens, 1.375 per row. At a break-even of 1.5 no row
    drafts (the batch keeps AR's look-ahead); at 1.3 the batch drafts, and only the row
    whose drafts are on carries them. AR requests count as rows whose drafts are off."""
    rows = [drafting(4.0)] + [drafts_off_for_now() for _ in range(6)]
    rows.append(Sequence(9, [1], GenerationParams(mode="ar")))
    rooms = batch_rooms(rows, break_even)
    assert rooms == ([4] + [0] * 7 if drafts else [0] * 8)
    assert batch_rooms(rows[:1], break_even) == [4]  # alone it pays


def test_a_wedlm_row_or_a_first_forward_makes_the_batch_draft():
    """A WeDLM window makes the forward wide anyway; a request's first forward (no gain
    yet) explores: in both, rows draft as their own state allows."""
    held = [drafting(1.6)] + [drafts_off_for_now() for _ in range(3)]
    assert batch_rooms(held, 1.5) == [0] * 4
    wedlm = Sequence(9, [1], GenerationParams(mode="wedlm"))
    assert batch_rooms([*held, wedlm], 1.5) == [4, 0, 0, 0, 0]
    assert batch_rooms([*held, new_seq()], 1.5) == [4, 0, 0, 0, 8]


def test_probes_of_a_batch_wait_for_its_probe_slot_and_run_together():
    """8 rows whose probes fail, due at staggered forwards: each alone would make a forward
    a drafting one; in a batch of 8 they wait for its slot (every 8 * PROBE_EVERY
    forwards: the batch explores as often as one row would) and probe together, and a
    held probe's state is left as it was until then."""
    rows = [new_seq() for _ in range(8)]
    for i, seq in enumerate(rows):
        seq.draft_limit = 0
        seq.draft_state.next_probe = 1 + i  # due at forwards 1..8
    n, drafting_forwards, probes = 64, 0, 0
    for _ in range(n):
        rooms = batch_rooms(rows, 1.5)
        drafting_forwards += any(rooms)
        for seq, room in zip(rows, rooms, strict=True):
            if room:
                probes += 1
                forward(seq, 1, 0, 1.5)  # rejected: the gap doubles
            else:
                seq.forwards += 1  # held, or drafts off: nothing changes
    assert probes >= 8  # every row probed
    assert drafting_forwards == 1
    assert all(s.draft_state.gap > PROBE_EVERY for s in rows)


def test_a_held_row_keeps_its_state():
    """apply_result of a row its batch held back (one row, no drafts) leaves its limit and
    gain as they were; the same forward without a hold would have halved its limit."""
    from coordinator.engine.modes import apply_result
    from coordinator.engine.modes.speculative import plan_speculative
    from coordinator.engine.sequence import Phase

    for room, limit in ((0, 4), (None, 2)):
        seq = drafting(2.0)
        seq.phase, seq.output, seq.kv_length, seq.forwards = Phase.DECODE, [3], 1, 5
        plan = plan_speculative(seq, 0, 4096, "lookup", 1.5, room)
        assert plan.width == 1 and plan.held is (room == 0)
        apply_result(plan, np.ones(1, bool), np.array([5]), 1.5)
        assert seq.draft_limit == limit and seq.draft_state.gain == 2.0


@pytest.fixture(scope="module")
def wedlm8(checkpoint_dir):
    from coordinator.engine.local_engine import open_local_engine

    return open_local_engine(checkpoint_dir("wedlm_qwen3", seed=82), num_rows=8)


TEXTS8 = ["count 1 2 3 1 2 3 1 2", "a b c a b", "the cat sat on the mat"] * 3


@pytest.mark.parametrize(("break_even", "drafts"), [(1.5, False), (1.3, True)])
def test_a_real_batch_of_eight_drafts_only_when_it_pays(wedlm8, break_even, drafts):
    """A real engine, 8 requests in one micro-batch: one speculative request whose drafts
    pay 4 tokens per forward, 7 whose drafts are off (six speculative, one AR). At a fixed
    break-even of 1.5 no forward of the batch drafts and the first keeps its state; at 1.3
    the batch drafts, and the rows whose drafts are off never carry any. Every output is
    AR's token for token."""
    engine = wedlm8.engine
    prompts = [wedlm8.tokenizer.encode(t) for t in TEXTS8[:8]]
    n = 24
    ar = [engine.submit(p, GenerationParams(mode="ar", max_tokens=n)) for p in prompts]
    for _ in engine.stream(ar):
        pass
    engine.step_cost.online = False
    engine.step_cost.seed({1: break_even})
    before = engine.speculative_batches, engine.drafting_batches
    spec = GenerationParams(mode="speculative", draft="mask", window=8, max_tokens=n)
    params = [spec] * 7 + [GenerationParams(mode="ar", max_tokens=n)]
    seqs = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    first = seqs[0]
    first.draft_limit, first.draft_state.gain = 4, 4.0
    for seq in seqs[1:7]:
        seq.draft_limit, seq.draft_state.next_probe = 0, 10**9
    for _ in engine.stream(seqs):
        pass
    assert [s.output for s in seqs] == [s.output for s in ar]
    batches = engine.speculative_batches - before[0]
    drafting_batches = engine.drafting_batches - before[1]
    assert batches >= n - 1
    assert all(s.draft_forwards == 0 for s in seqs[1:7])
    if drafts:
        assert drafting_batches >= 1 and first.draft_forwards == drafting_batches
    else:
        assert drafting_batches == 0 and first.draft_forwards == 0
        assert first.draft_limit == 4 and first.draft_state.gain == 4.0


def test_a_spell_without_a_gain_waits_for_the_slot_unless_it_verifies():
    """In a batch of several rows, a spell whose mask slots found nothing confident yet (no
    gain, no drafts) explores only at the batch's probe slot; with drafts to verify it
    explores at once (they are gone after one forward)."""
    unproven = new_seq()
    unproven.draft_limit, unproven.forwards = 4, 2
    rows = [unproven] + [drafts_off_for_now() for _ in range(3)]
    for seq in rows:
        seq.draft_state.gap = 64  # (rows whose drafts are off set the slot's gap)
    assert batch_rooms(rows, 1.5) == [0] * 4
    unproven.drafts = np.array([7, 8], np.int32)
    assert batch_rooms(rows, 1.5) == [4, 0, 0, 0]
    unproven.drafts = np.zeros(0, np.int32)
    unproven.forwards = PROBE_MAX - 1  # the slot: every min(64 * 4, PROBE_MAX) forwards
    assert batch_rooms(rows, 1.5) == [4, 0, 0, 0]
    assert batch_rooms(rows, 1.5, ahead=1) == [0] * 4


def test_a_real_mask_probe_rides_the_look_ahead(wedlm8):
    """A real engine, one speculative request whose drafts are off with a probe due at its
    8th forward (the prompt's counts as its first): the probe (one token and two mask
    slots) and the forward after it are both launched ahead, so every forward after the
    first decode forward is (until a right guess resumes drafting). The output is AR's
    token for token."""
    engine = wedlm8.engine
    prompt = wedlm8.tokenizer.encode(TEXTS8[0])
    n = 20
    ar = engine.submit(prompt, GenerationParams(mode="ar", max_tokens=n))
    for _ in engine.stream([ar]):
        pass
    engine.step_cost.online = False
    engine.step_cost.seed({1: 1.5})
    ahead: list[int] = []  # widths of the look-ahead forwards, in order
    launch = engine._launch_ahead

    def spy(*args):
        launched = launch(*args)
        if launched:
            ahead.append(max(p.width for p in engine.in_flight[-1].plans))
        return launched

    engine._launch_ahead = spy
    try:
        spec = GenerationParams(mode="speculative", draft="mask", max_tokens=n)
        seq = engine.submit(prompt, spec)
        seq.draft_limit, seq.draft_state.next_probe = 0, PROBE_EVERY
        for _ in engine.stream([seq]):
            pass
    finally:
        del engine._launch_ahead
    assert seq.output == ar.output and seq.forwards > PROBE_EVERY + 1
    # forwards 3 .. 7 one row, the 8th the probe, the 9th one row again
    assert ahead[: PROBE_EVERY - 1] == [1] * (PROBE_EVERY - 3) + [3, 1]
    if seq.draft_forwards == 1:  # the guess was wrong, or nothing was confident
        assert len(ahead) == seq.forwards - 2 and seq.draft_limit == 0


def test_a_held_row_the_batch_lets_draft_again_waits_for_the_regular_launch():
    """modes/ar.py's next_plans: a row held back at t whose batch would now let it draft (its
    gain pays) is not planned ahead as one row again (it would be held for good): the
    regular launch plans its drafts."""
    seq = drafting(4.0)
    seq.params = GenerationParams(mode="speculative", draft="mask")
    seq.phase, seq.output, seq.kv_length = Phase.DECODE, [3], 1
    held = plan_speculative(seq, 99, 4096, "mask", 1.5, room=0)
    assert held.width == 1 and held.held and batch_rooms([seq], 1.5, ahead=1) == [4]
    assert next_plans([held], 1.5, 99, 4096) is None


def test_a_drafting_forward_launched_after_the_read_back_is_priced_from_it(wedlm8):
    """A drafting forward launched after the last read-back makes the device wait for the
    host's work in between (postprocess, planning), which AR's look-ahead hides: its cost
    is the time from that read-back, as an AR forward's is. Here 30 ms of host work
    before each regular launch shows in every drafting forward the online pricing sees
    (priced from its own launch, 4-row drafts cost 1.0 AR forwards on an H100)."""
    engine = wedlm8.engine
    prompt = wedlm8.tokenizer.encode(TEXTS8[0])
    engine.step_cost.seed({1: 1.0})  # drafts pay whenever anything is accepted
    params = GenerationParams(mode="speculative", draft="mask", max_tokens=24)
    # once first, unobserved: a forward of a new shape compiles and is never priced
    warm = engine.submit(prompt, params)
    for _ in engine.stream([warm]):
        pass
    regular: set[int] = set()  # forwards launched after a read-back (not look-aheads)
    timing: list[bool] = [False]  # whether the forward being timed is one of them
    seen: list[tuple[str, bool, float]] = []
    observe, launch, time_forward = (
        engine.step_cost.observe, engine._launch, engine.clock.observe
    )  # fmt: skip

    def spy(kind, rows, seconds):
        seen.append((kind, timing[0], seconds))
        observe(kind, rows, seconds)

    def slow_launch(unit, plans):
        time.sleep(0.03)  # the host's work between a read-back and a regular launch
        launch(unit, plans)
        regular.add(engine.in_flight[-1].batch_id)

    def timed(step_cost, flight, micro_batches):
        timing[0] = flight.batch_id in regular
        time_forward(step_cost, flight, micro_batches)

    engine.step_cost.observe, engine._launch, engine.clock.observe = spy, slow_launch, timed
    try:
        seq = engine.submit(prompt, params)
        for _ in engine.stream([seq]):
            pass
    finally:
        del engine.step_cost.observe, engine._launch, engine.clock.observe
        engine.step_cost.seed({})
    # drafting forwards launched regularly (a mask probe rides AR's look-ahead instead)
    drafts = [s for kind, launched, s in seen if kind == DRAFT and launched]
    assert seq.draft_forwards > 0 and drafts
    assert min(drafts) >= 0.03
