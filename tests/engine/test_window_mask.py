"""The explicit-mask form of topological reordering, checked against the spec's example."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.window_mask import attention_mask, window_visibility
from tests.support.reference_wedlm import Window


def physical_rank(filled: list[bool]) -> list[int]:
    order = [i for i, f in enumerate(filled) if f] + [i for i, f in enumerate(filled) if not f]
    return [order.index(i) for i in range(len(filled))]


def test_spec_worked_example_step_2():
    # W = 4, step 2: window `a M c M M` → rows fed a, c, M@L+1, M@L+3, M@L+4.
    filled = [True, False, True, False, False]
    vis = window_visibility(np.array(filled))
    rank = physical_rank(filled)
    assert [rank.index(r) for r in range(5)] == [0, 2, 1, 3, 4]
    for i in range(5):
        for j in range(5):
            assert vis[i, j] == (rank[j] <= rank[i])


def test_visibility_equals_causal_over_the_reference_physical_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = int(rng.integers(1, 20))
        filled = rng.random(t) < 0.5
        w = Window(list(range(t)), list(~filled))
        rank = physical_rank(list(filled))
        assert w.physical_order() == [rank.index(r) for r in range(t)]
        vis = window_visibility(filled)
        expected = np.array([[rank[j] <= rank[i] for j in range(t)] for i in range(t)])
        assert np.array_equal(vis, expected)


def test_all_filled_is_causal():
    assert np.array_equal(window_visibility(np.ones(6, bool)), np.tri(6, dtype=bool))


def test_attention_mask_over_the_cache():
    windows = np.stack([window_visibility(np.array([True, False, False]))] * 2)
    mask = np.array(attention_mask(mx.array([2, 4]), mx.array(windows), 8))[:, 0]
    # row 0: keys 0,1 committed; window at 2..4; 5..7 stale
    assert mask[0, 1].tolist() == [True, True, True, True, False, False, False, False]
    assert mask[0, 0].tolist() == [True, True, True, False, False, False, False, False]
    # row 1: keys 0..3 committed; window at 4..6
    assert mask[1, 2].tolist() == [True] * 4 + [True, True, True, False]
