"""Speculative mode's look-ahead (coordinator/engine/speculative_ahead.py): the next
verifying forward built on the device from a step's choices must be exactly the row the
host plans once it has read that step back (speculative_ahead.resolve, after
row_plan.apply_result): the same pending tokens, drafts and mask slots, whatever was
accepted, guessed confidently or capped. (Outputs against AR's on a real engine:
test_speculative.test_mask_drafts_chained_on_the_device_give_the_autoregressive_tokens.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.generation_params import GenerationParams
from coordinator.engine.modes import apply_result
from coordinator.engine.modes import speculative as speculative_ahead
from coordinator.engine.modes.speculative import plan_speculative
from coordinator.engine.sequence import Phase, Sequence

MASK = 999


def drafting_seq(seq_id: int, drafts: list[int], limit: int) -> Sequence:
    """A speculative request past its prompt with drafts to verify."""
    seq = Sequence(seq_id, [1, 2, 3], GenerationParams(mode="speculative", draft="mask"))
    seq.phase, seq.output, seq.kv_length, seq.forwards = Phase.DECODE, [7], 3, 4
    seq.draft_limit, seq.draft_state.gain = limit, 3.0
    seq.drafts = np.array(drafts, np.int32)
    return seq


def test_the_device_row_equals_the_host_plan():
    """Random batches of 8 rows: drafts accepted in full (their confident guesses then
    drafted, up to the row's limit), in part, or not at all; every kind comes up."""
    rng = np.random.default_rng(0)
    seen = {"all accepted, guesses drafted": 0, "some rejected": 0, "capped": 0}
    for _ in range(6):
        plans, tokens_rows, fills_rows = [], [], []
        for i in range(8):
            drafts = [int(t) for t in rng.integers(10, 20, int(rng.integers(0, 5)))]
            seq = drafting_seq(i, drafts, limit=int(rng.integers(1, 9)))
            plan = plan_speculative(seq, MASK, 4096, "mask")
            if i % 2:  # a forward built on the device already: mask slots to its width
                plan = speculative_ahead.resolve(plan, 16, seq.draft_limit, MASK)
            k, slots = plan.drafts, plan.head_slots.size
            choices = rng.integers(10, 20, slots).astype(np.int32)
            for j in range(k):  # each draft the model's choice with probability 3/4
                if rng.random() < 3 / 4:
                    choices[j] = plan.tokens[plan.keep + j]
            plans.append(plan)
            tokens_rows.append(choices)
            fills_rows.append(rng.random(slots) < 0.8)
        width = 24
        k_slots = max(t.size for t in tokens_rows)
        tokens = np.zeros((len(plans), k_slots), np.int32)
        fills = np.zeros((len(plans), k_slots), bool)
        for i, (t, f) in enumerate(zip(tokens_rows, fills_rows, strict=True)):
            tokens[i, : t.size], fills[i, : f.size] = t, f
        caps = speculative_ahead.caps(plans)
        ids = speculative_ahead.next_inputs(
            plans, mx.array(fills), mx.array(tokens), MASK, width, 2, caps
        )
        ids = np.array(ids)
        assert ids.shape == (len(plans) + 2, width)
        for i, plan in enumerate(plans):
            seq = plan.seq
            slots = plan.head_slots.size
            apply_result(plan, fills[i, :slots], tokens[i, :slots])
            want = speculative_ahead.resolve(plan, width, caps[i], MASK)
            assert ids[i].tolist() == want.tokens.tolist()
            assert want.keep == len(seq.output) - (seq.kv_length - len(seq.prompt))
            assert want.head_slots.tolist() == list(range(want.keep - 1, width))
            assert want.head_is_mask.sum() == width - want.keep - want.drafts
            accepted = want.keep - 1 == plan.drafts
            seen["all accepted, guesses drafted"] += accepted and want.drafts > 0
            seen["some rejected"] += not accepted
            seen["capped"] += seq.drafts.size > caps[i]
    assert all(seen.values()), seen


def test_chains_only_drafting_mask_rows():
    plan = plan_speculative(drafting_seq(0, [11, 12], limit=4), MASK, 4096, "mask")
    assert speculative_ahead.chains(plan)
    plan.seq.draft_limit = 0  # drafts off: a probe or AR's look-ahead, not a spell
    assert not speculative_ahead.chains(plan)
    lookup = drafting_seq(1, [], limit=4)
    lookup.params = GenerationParams(mode="speculative", draft="lookup")
    assert not speculative_ahead.chains(plan_speculative(lookup, MASK, 4096, "lookup"))
