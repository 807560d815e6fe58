"""Warm start and the bounded set of forward shapes: warm_up runs the first shapes and
leaves nothing behind, the first requests after it run no new shape, and a long mixed
workload never leaves the set that ShapeLimits counts."""

from __future__ import annotations

import json
import random

import pytest

from common.generation_params import GenerationParams
from common.kv_rows import SPAN_STEP
from coordinator.engine.forward_shapes import ShapeLimits, padded_width, round_up, row_bucket
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.pipeline import LocalPipeline
from coordinator.engine.warmup import WARM_IDS, warm_up
from coordinator.service.engine_loop import EngineLoop
from coordinator.service.metrics import Metrics

ROWS = 4  # max_running of the engines here


class CheckingPipeline(LocalPipeline):
    """Checks every forward as a worker does (known sequences, starts equal to the KV
    lengths held, positions within the context), so warm-up would pass a real worker."""

    def submit(self, batch_id, spec, hidden, reply_slots=None) -> None:
        self.runner.check(spec, hidden.shape)
        super().submit(batch_id, spec, hidden, reply_slots)


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen3", seed=11, max_position_embeddings=1024)


def open_engine(model):
    local = open_local_engine(model, num_rows=ROWS)
    local.engine.pipeline = CheckingPipeline(local.engine.parts)
    return local


@pytest.fixture(scope="module")
def warmed(model):
    local = open_engine(model)
    report = warm_up(local.engine)
    return local, report


def run_all(engine, requests):
    """Submit (prompt, params) pairs together and decode them to the end."""
    seqs = [engine.submit(prompt, params) for prompt, params in requests]
    for _ in engine.stream(seqs):
        pass
    return [s.output for s in seqs]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 * salt + 1) % 300 for i in range(n)]


def test_the_bound_counts_exactly_the_shapes_the_rules_allow():
    limits = ShapeLimits(max_rows=20, max_width=200, max_positions=300)
    reachable = {
        (row_bucket(n), padded_width(w), round_up(start + padded_width(w), SPAN_STEP))
        for n in range(1, 21)
        for w in range(1, 201)
        for start in range(300)  # the furthest row starts anywhere in the context
    }
    assert len(reachable) == limits.bound()
    assert all(limits.admits(key) for key in reachable)
    assert not limits.admits((3, 8, 64)) and not limits.admits((4, 9, 64))
    assert not limits.admits((4, 8, round_up(300 + 8, SPAN_STEP) + SPAN_STEP))


def test_warm_up_runs_the_first_shapes_and_leaves_nothing_behind(warmed):
    local, report = warmed
    engine = local.engine
    store = engine.pipeline.runner.store
    assert len(store) == 0 and store.batches == []
    assert not engine.pipeline._done and not engine.in_flight
    assert engine.forwards == 0 and not engine.running and not engine.waiting
    assert report.new_shapes == report.shapes == engine.shapes.count > 0
    assert report.keys == engine.shapes.seen
    limits = engine.shape_limits()
    assert all(limits.admits(key) for key in report.keys)
    rows = {r for r, _, _ in report.keys}
    widths = {t for _, t, _ in report.keys}
    assert rows == {1, 2, 4}
    assert {1, 16, 24, 32} <= widths  # AR rows and the WeDLM widths of the default window
    assert {padded_width(n) for n in range(2, 513)} <= widths  # every prompt chunk width
    assert {s for _, t, s in report.keys if t == 1} == {64, 128}  # two spans by default
    print(f"warm-up: {report.forwards} forwards, {report.shapes} shapes, {report.seconds:.2f} s")
    # Warming again runs the same shapes and adds none; real ids still start at 0.
    again = warm_up(engine)
    assert again.keys == report.keys and again.new_shapes == 0
    seq = engine.submit(prompt(3), GenerationParams(mode="ar", max_tokens=1))
    assert seq.seq_id == 0 < WARM_IDS
    for _ in engine.stream([seq]):
        pass


@pytest.mark.parametrize(
    "requests",
    [
        [("ar", 16, 5, 12)],
        [("wedlm", 16, 9, 24)],
        [("ar", 16, 3, 20), ("ar", 16, 17, 8), ("ar", 16, 1, 30)],
        [("wedlm", 16, 4, 20), ("wedlm", 16, 11, 30), ("wedlm", 16, 20, 10), ("wedlm", 16, 2, 16)],
        [("wedlm", 4, 6, 20), ("wedlm", 8, 13, 20), ("ar", 16, 7, 20)],
        [("ar", 16, 40, 10), ("wedlm", 16, 33, 20)],
    ],
    ids=["ar", "wedlm", "3-ar", "4-wedlm", "windows-4-8-and-ar", "longer-prompts"],
)
def test_first_requests_after_warm_up_run_no_new_shape(model, warmed, requests):
    local, report = warmed
    engine = local.engine
    before = set(engine.shapes.seen)
    work = [
        (prompt(n, salt=i), GenerationParams(mode=mode, window=w, threshold=1.0, max_tokens=m))
        for i, (mode, w, n, m) in enumerate(requests)
    ]
    run_all(engine, work)
    assert engine.shapes.seen == before, sorted(engine.shapes.seen - before)
    # Not vacuous: an engine that did not warm up runs new shapes for the same requests,
    # and every one of them is one that warm-up ran.
    fresh = open_engine(model).engine
    run_all(fresh, work)
    assert fresh.shapes.count > 0
    assert fresh.shapes.seen <= report.keys, sorted(fresh.shapes.seen - report.keys)


def test_outputs_after_warm_up_equal_a_fresh_engine(model, warmed):
    local, _ = warmed
    fresh = open_engine(model)
    work = [
        (prompt(9, 1), GenerationParams(mode="ar", max_tokens=20)),
        (prompt(14, 2), GenerationParams(mode="wedlm", window=16, threshold=1.5, max_tokens=24)),
        (prompt(70, 3), GenerationParams(mode="wedlm", window=8, max_tokens=16)),
        (prompt(5, 4), GenerationParams(mode="ar", max_tokens=12)),
    ]
    assert run_all(local.engine, work) == run_all(fresh.engine, work)
    assert fresh.engine.shapes.count > 0


def test_a_long_mixed_workload_stays_within_the_bound(warmed):
    local, _ = warmed
    engine = local.engine
    limits = engine.shape_limits()
    bound = limits.bound()
    rng = random.Random(5)
    lengths = [1, 2, 7, 8, 9, 63, 64, 65, 129, 300, 511, 512, 513, 600]
    lengths += [rng.randint(1, 600) for _ in range(10)]
    rng.shuffle(lengths)
    pending = []
    for i, n in enumerate(lengths):
        mode = rng.choice(["ar", "wedlm"])
        window = rng.choice([4, 8, 16])
        threshold = rng.choice([0.4, 1.5, 10.0])
        params = GenerationParams(
            mode=mode, window=window, threshold=threshold, max_tokens=rng.randint(1, 24)
        )
        pending.append((prompt(n, salt=i), params))
    seqs = []
    while pending or engine.has_work:
        # vary the concurrency: submit a few whenever fewer than a random target run
        target = rng.randint(1, ROWS)
        while pending and len(engine.running) + len(engine.waiting) < target:
            seqs.append(engine.submit(*pending.pop()))
        engine.step()
        assert engine.shapes.count <= bound
    assert all(s.finished for s in seqs) and len(seqs) == len(lengths)
    assert all(limits.admits(key) for key in engine.shapes.seen)
    assert engine.shapes.count <= bound
    widths = {t for _, t, _ in engine.shapes.seen}
    assert {1, 512} <= widths and max(s for _, _, s in engine.shapes.seen) > 512  # chunked
    print(f"{engine.shapes.count} shapes after the workload; bound {bound}")


def test_the_shape_count_is_a_metric(warmed):
    local, _ = warmed
    metrics = Metrics()
    loop = EngineLoop(local.engine, local.tokenizer, metrics)
    loop._gauges()
    value = metrics.registry.get_sample_value("wedlm:forward_shapes")
    assert value == local.engine.shapes.count > 0


def test_two_stages_measure_the_draft_break_even_through_the_worker(model, tmp_path):
    """A coordinator and one worker on CPU (warm-up auto: no shapes are warmed there) run
    2 micro-batches, whose overlapping forwards cannot price drafts online; so once it
    serves and is idle, the coordinator measures the break-even through the worker, per
    row bucket of a decode group, and keeps it for the next start. Speculative requests
    through the 2 stages then give AR's tokens."""
    from tests.support.cluster_harness import (
        cluster_name,
        engine_outputs,
        start_coordinator,
        start_worker,
    )
    from wedlm_client.client import WedlmClient

    name = cluster_name()
    worker, waddr = start_worker(model, name, "--no-bonjour")
    coord = None
    try:
        coord, address = start_coordinator(
            model, name, "--no-bonjour", "--worker", waddr, "--expect", "1",
            "--max-running", "4", env={"WEDLM_CACHE_DIR": str(tmp_path)},
        )  # fmt: skip
        coord.expect("serving")
        measured = coord.expect(r"draft break-even \(.*by rows\): (.*), measured in")
        assert [b.split(":")[0] for b in measured.group(1).split(", ")] == ["1", "2"]
        assert not any("warm-up:" in line for line in coord.log)  # no shapes on CPU
        kept = json.loads((tmp_path / "measured-step-costs.json").read_text())
        assert [list(e["ratios"]) for e in kept.values()] == [["1", "2"]]
        texts = ["count 1 2 3 1 2 3 1 2", "a b c a b", "the cat sat on the mat"]
        ar = GenerationParams(mode="ar", max_tokens=16)
        spec = GenerationParams(mode="speculative", draft="mask", window=4, max_tokens=16)
        expected = engine_outputs(model, [(t, ar) for t in texts])
        with WedlmClient(address, timeout=120) as client:
            got = [client.generate(text=t, params=spec)["tokens"] for t in texts]
        assert got == expected
    finally:
        if coord is not None:
            coord.stop()
        worker.stop()


def test_the_background_warm_up_runs_the_rest_between_requests(model, warmed):
    """A server warms one request's shapes before readiness and the larger batches' while
    idle, one forward per step (WarmUpRun): a request run between two steps decodes as on a
    fresh engine, and at the end the union is the whole set, with no warm-up row left."""
    from coordinator.engine.warmup import WarmUpRun, row_buckets

    _, full = warmed
    local = open_engine(model)
    engine = local.engine
    first = warm_up(engine, max_rows=1, timing=False)
    assert {r for r, _, _ in first.keys} == {1}
    run = WarmUpRun(engine, [r for r in row_buckets(ROWS) if r > 1])
    fresh = open_engine(model).engine
    work = [
        (prompt(9, 1), GenerationParams(mode="ar", max_tokens=12)),
        (prompt(14, 2), GenerationParams(mode="wedlm", window=16, threshold=1.5, max_tokens=16)),
    ]
    steps = 0
    while run.step():
        steps += 1
        if steps == 3:  # mid-bucket: the warm-up holds rows of its own in the store
            assert len(engine.pipeline.runner.store) > 0
            assert run_all(engine, work) == run_all(fresh, work)
            while engine.in_flight:  # a look-ahead launched before the last rows ended
                engine.step()
    assert steps > 3 and run.done and not run.step()
    store = engine.pipeline.runner.store
    assert len(store) == 0  # every warm-up row released
    assert engine.forwards > 0  # the request's forwards; the warm-up counts none
    assert full.keys <= engine.shapes.seen  # one request's, the rest, and what work ran


def test_startup_costs_run_the_background_warm_up_first_while_idle(model, monkeypatch):
    """The server's idle work (StartupCosts) steps the background warm-up one forward at a
    time once the engine has been idle, and then has nothing left to do."""
    from coordinator.engine.warmup import WarmUpRun
    from coordinator.service import startup_costs
    from coordinator.service.startup_costs import StartupCosts

    monkeypatch.setattr(startup_costs, "IDLE_BEFORE_S", 0.0)
    engine = open_engine(model).engine
    costs = StartupCosts(engine, key=lambda: None, rows=lambda: [], store=None)
    run = WarmUpRun(engine, [2, 4])
    costs.warm_in_background(run)
    steps = 0
    while costs.due() or costs.due():  # the first call after a change only notes the time
        costs.step()
        steps += 1
    assert run.done and steps == run.warmer.forwards + 1  # the last step finds it done
    assert run.warmer.forwards > 0
    assert {r for r, _, _ in run.warmer.keys} == {2, 4}
    assert len(engine.pipeline.runner.store) == 0
