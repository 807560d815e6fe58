"""The layer planner: proportional splits that lose no layer, memory limits, and the checks
on fixed `--layers` ranges (alone and mixed with workers that take the gaps)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.layer_range import LayerRange
from coordinator.cluster.layer_plan import PlanError, WorkerCapacity, plan_layers

GIB = 1 << 30


def free(*gib: float) -> list[WorkerCapacity]:
    return [WorkerCapacity(f"w{i}", int(g * GIB), None) for i, g in enumerate(gib)]


def sizes(plan: dict[str, LayerRange]) -> list[int]:
    return [len(r) for r in plan.values()]


def assert_tiles(plan: dict[str, LayerRange], num_layers: int) -> None:
    ranges = list(plan.values())
    assert ranges[0].start == 0 and ranges[-1].end == num_layers - 1
    for a, b in itertools.pairwise(ranges):
        assert b.start == a.end + 1
    assert sum(sizes(plan)) == num_layers


@pytest.mark.parametrize(
    ("num_layers", "workers", "want"),
    [
        (10, 3, [4, 3, 3]),
        (36, 5, [8, 7, 7, 7, 7]),
        (7, 7, [1] * 7),
        (1, 1, [1]),
        (36, 4, [9, 9, 9, 9]),
    ],
)
def test_equal_workers_split_evenly_and_lose_no_layer(num_layers, workers, want):
    plan = plan_layers(num_layers, free(*[64] * workers), GIB // 4, 0)
    assert sizes(plan) == want
    assert list(plan) == [f"w{i}" for i in range(workers)]  # given order is pipeline order
    assert_tiles(plan, num_layers)


def test_ranges_follow_worker_order():
    plan = plan_layers(10, free(8, 8, 8), GIB // 4, 0)
    assert plan == {"w0": LayerRange(0, 3), "w1": LayerRange(4, 6), "w2": LayerRange(7, 9)}


def test_same_inputs_same_plan():
    workers = free(13, 7.5, 21, 3)
    assert plan_layers(48, workers, GIB // 8, GIB // 64) == plan_layers(
        48, list(workers), GIB // 8, GIB // 64
    )


def test_memory_ratio_two_to_one_gives_layers_two_to_one():
    assert sizes(plan_layers(36, free(32, 16), GIB // 4, 0)) == [24, 12]
    assert sizes(plan_layers(35, free(32, 16), GIB // 4, 0)) in ([24, 11], [23, 12])


def test_tiny_worker_still_gets_one_layer():
    plan = plan_layers(10, free(100, 100, 1.2), GIB, 0)
    assert sizes(plan) == [5, 4, 1]
    assert_tiles(plan, 10)


def test_kv_reserve_moves_a_layer_off_the_small_worker():
    # Without KV the small worker fits 2 layers; with 0.1 GiB of KV per layer only 1.
    workers = [WorkerCapacity("big", 10 * GIB, None), WorkerCapacity("small", 2 * GIB, None)]
    assert sizes(plan_layers(10, workers, GIB, 0)) == [8, 2]
    assert sizes(plan_layers(10, workers, GIB, GIB // 10)) == [9, 1]


def test_never_more_layers_than_fit():
    # Shares would be 3.44/1.56 and round to 3/2, but the second worker fits only one layer.
    plan = plan_layers(5, free(4.4, 2), int(1.1 * GIB), 0)
    assert sizes(plan) == [4, 1]


def test_too_little_memory_says_how_much_is_missing():
    with pytest.raises(PlanError) as err:
        plan_layers(36, free(8, 8), GIB // 2, GIB // 4)
    msg = str(err.value)
    assert "the model's 36 layers do not fit" in msg
    assert "can hold only 20" in msg
    assert "about 12.0 GiB more memory (16 layers' worth) is missing" in msg


def test_worker_without_room_for_one_layer():
    with pytest.raises(PlanError, match=r"worker w1 has room for no layer: 512\.0 MiB available"):
        plan_layers(10, free(64, 0.5), GIB, 0)


def test_more_workers_than_layers():
    with pytest.raises(PlanError, match="4 workers but the model has 3 layers"):
        plan_layers(3, free(8, 8, 8, 8), GIB, 0)


def test_duplicate_keys_and_no_workers():
    with pytest.raises(PlanError, match="listed twice"):
        plan_layers(4, [WorkerCapacity("a", GIB * 8, None)] * 2, GIB, 0)
    with pytest.raises(PlanError, match="no worker"):
        plan_layers(4, [], GIB, 0)


# ---- fixed ranges ----------------------------------------------------------------------


def fixed(**ranges: str) -> list[WorkerCapacity]:
    return [WorkerCapacity(key, 0, LayerRange.parse(r)) for key, r in ranges.items()]


def test_fixed_ranges_that_tile_are_kept_in_layer_order():
    plan = plan_layers(36, fixed(B="18-35", A="0-17"), GIB, 0)
    assert plan == {"A": LayerRange(0, 17), "B": LayerRange(18, 35)}
    assert plan_layers(1, fixed(A="0-0"), GIB, 0) == {"A": LayerRange(0, 0)}


def test_gap_is_named():
    with pytest.raises(PlanError, match=r"^layers 12-17 are held by no worker$"):
        plan_layers(36, fixed(A="0-11", B="18-35"), GIB, 0)
    with pytest.raises(PlanError, match="layer 35 is held by no worker"):
        plan_layers(36, fixed(A="0-34"), GIB, 0)


def test_overlap_is_named():
    with pytest.raises(PlanError, match=r"^layers 10-11 are held by both A and B$"):
        plan_layers(36, fixed(A="0-11", B="10-35"), GIB, 0)


def test_range_past_the_model_is_named():
    with pytest.raises(PlanError) as err:
        plan_layers(36, fixed(A="0-29", B="30-40"), GIB, 0)
    assert str(err.value) == "worker B holds 30-40 but the model has 36 layers (0-35)"


def test_all_problems_reported_at_once():
    with pytest.raises(PlanError) as err:
        plan_layers(36, fixed(A="0-11", B="10-20", C="30-40"), GIB, 0)
    msg = str(err.value)
    assert "worker C holds 30-40" in msg
    assert "layers 10-11 are held by both A and B" in msg
    assert "layers 21-29 are held by no worker" in msg


# ---- fixed and free together -----------------------------------------------------------


def test_free_worker_takes_the_gap():
    workers = [*fixed(A="0-11", B="18-35"), *free(8)]
    plan = plan_layers(36, workers, GIB // 4, 0)
    assert plan == {"A": LayerRange(0, 11), "w0": LayerRange(12, 17), "B": LayerRange(18, 35)}


def test_free_workers_split_each_gap_by_memory():
    workers = [*fixed(A="10-20"), *free(16, 16, 64, 4)]
    plan = plan_layers(36, workers, GIB // 4, 0)
    # gap 0-9 goes to the two 16 GiB workers, gap 21-35 to the 64 and 4 GiB ones.
    assert plan == {
        "w0": LayerRange(0, 4),
        "w1": LayerRange(5, 9),
        "A": LayerRange(10, 20),
        "w2": LayerRange(21, 34),
        "w3": LayerRange(35, 35),
    }


def test_free_workers_with_no_gap():
    with pytest.raises(PlanError, match=r"1 worker without --layers \(w0\) got no layer"):
        plan_layers(36, [*fixed(A="0-35"), *free(8)], GIB, 0)


def test_more_gaps_than_free_workers():
    with pytest.raises(PlanError) as err:
        plan_layers(36, [*fixed(A="0-11", B="18-29"), *free(8)], GIB // 4, 0)
    msg = str(err.value)
    assert msg.startswith("layers 12-17, 30-35 are held by no worker")
    assert "cannot cover 2 separate gaps" in msg


def test_more_free_workers_than_free_layers():
    with pytest.raises(PlanError, match=r"only 2 free layers \(34-35\)"):
        plan_layers(36, [*fixed(A="0-33"), *free(8, 8, 8)], GIB // 4, 0)


def test_gap_too_big_for_free_memory():
    with pytest.raises(PlanError, match=r"the 6 layers left free \(12-17\) do not fit"):
        plan_layers(36, [*fixed(A="0-11", B="18-35"), *free(4)], GIB, 0)


def test_no_grouping_fits_memory():
    # Enough memory in total, but the big worker comes first and the big gap second.
    workers = [*fixed(A="1-10"), *free(64, 1)]
    with pytest.raises(PlanError, match="no way to split 2 workers without --layers"):
        plan_layers(36, workers, GIB, 0)


def test_fixed_errors_come_before_filling():
    with pytest.raises(PlanError, match="held by both A and B"):
        plan_layers(36, [*fixed(A="0-11", B="11-20"), *free(64)], GIB, 0)


# ---- property --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    num_layers=st.integers(1, 96),
    memories=st.lists(st.integers(1, 10_000), min_size=1, max_size=12),
    layer_bytes=st.integers(1, 50),
    kv=st.integers(0, 20),
)
def test_plan_tiles_the_model(num_layers, memories, layer_bytes, kv):
    workers = [WorkerCapacity(f"w{i}", m, None) for i, m in enumerate(memories)]
    room = [m // (layer_bytes + kv) for m in memories]
    if len(workers) > num_layers or min(room) < 1 or sum(room) < num_layers:
        with pytest.raises(PlanError):
            plan_layers(num_layers, workers, layer_bytes, kv)
        return
    plan = plan_layers(num_layers, workers, layer_bytes, kv)
    assert list(plan) == [w.key for w in workers]
    assert_tiles(plan, num_layers)
    for got, fits in zip(sizes(plan), room, strict=True):
        assert 1 <= got <= fits
    # More memory never means fewer layers.
    by_memory = sorted(zip(memories, sizes(plan), strict=True))
    for (m_a, got_a), (m_b, got_b) in itertools.pairwise(by_memory):
        assert got_a <= got_b or m_a == m_b
    # Where no bound binds, each share is its proportional quota rounded up or down.
    quotas = [num_layers * m / sum(memories) for m in memories]
    if all(1 <= q <= fits for q, fits in zip(quotas, room, strict=True)):
        for got, q in zip(sizes(plan), quotas, strict=True):
            assert abs(got - q) < 1 + 1e-9


@settings(max_examples=200, deadline=None)
@given(
    num_layers=st.integers(2, 64),
    cuts=st.lists(st.integers(1, 63), max_size=6, unique=True),
    pinned=st.lists(st.booleans(), min_size=7, max_size=7),
)
def test_mixed_plans_tile_or_fail_cleanly(num_layers, cuts, pinned):
    bounds = [0, *sorted(c for c in cuts if c < num_layers), num_layers]
    pieces = [LayerRange(a, b - 1) for a, b in itertools.pairwise(bounds)]
    workers = [
        WorkerCapacity(f"w{i}", 1000, piece if pinned[i] else None)
        for i, piece in enumerate(pieces)
    ]
    try:
        plan = plan_layers(num_layers, workers, 10, 0)
    except PlanError:
        return
    assert_tiles(plan, num_layers)
    for w in workers:
        if w.fixed is not None:
            assert plan[w.key] == w.fixed
