"""Continuous batching on one process: batch invariance, micro-batches, chunked prefill
that never stalls running streams, queue limits, cancellation."""

from __future__ import annotations

import pytest

from common.generation_params import GenerationParams
from coordinator.engine.engine import Limits
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.scheduler import PREFILL, QueueFull

REQUESTS = [
    ("the cat sat on the mat", GenerationParams(threshold=1.5, max_tokens=24)),
    ("count 1 2 3", GenerationParams(window=4, threshold=None, max_tokens=16)),
    ("hello world", GenerationParams(mode="ar", max_tokens=20)),
    (
        "a much longer prompt about dogs, cats and birds",
        GenerationParams(window=8, threshold=10.0, max_tokens=30),
    ),
    ("zz", GenerationParams(threshold=0.4, penalty=0.1, max_tokens=12)),
]


def run_all(local, requests):
    seqs = [local.engine.submit(local.tokenizer.encode(t), p) for t, p in requests]
    for _ in local.engine.stream(seqs):
        pass
    return [s.output for s in seqs]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen3", seed=31)


def test_batch_invariance(model):
    """Greedy tokens of a request do not depend on which requests share its batch."""
    alone = []
    single = open_local_engine(model, num_rows=1)
    for req in REQUESTS:
        alone += run_all(single, [req])
    for rows, micro in ((5, 1), (3, 2), (5, 3)):
        local = open_local_engine(model, num_rows=rows)
        local.engine.use_pipeline(local.engine.pipeline, micro)
        assert run_all(local, REQUESTS) == alone, (rows, micro)


def test_a_sequence_is_in_at_most_one_micro_batch_and_groups_balance(model):
    local = open_local_engine(model, num_rows=8)
    engine = local.engine
    engine.use_pipeline(engine.pipeline, 3)
    seqs = [
        engine.submit(local.tokenizer.encode(f"prompt {i}"), GenerationParams(max_tokens=40))
        for i in range(8)
    ]
    seen_balanced = False
    while any(not s.finished for s in seqs):
        engine.step()
        in_flight = [p.seq.seq_id for f in engine.in_flight for p in f.plans]
        assert len(in_flight) == len(set(in_flight))
        sizes = [len(g) for g in engine.scheduler.groups]
        if sum(sizes) == 8:
            assert max(sizes) - min(sizes) <= 1
            seen_balanced = True
    assert seen_balanced


def test_long_prompt_is_chunked_and_does_not_stall_decoding(model):
    limits = Limits(prefill_chunk=32, prefill_budget=32)
    local = open_local_engine(model, num_rows=2)
    engine = local.engine
    engine.scheduler.limits = limits
    engine.prefill_chunk = 32
    first = engine.submit(
        local.tokenizer.encode("short"), GenerationParams(mode="ar", max_tokens=60)
    )
    while not first.output:
        engine.step()
    long_prompt = local.tokenizer.encode("word " * 40)
    assert len(long_prompt) > 4 * 32
    second = engine.submit(long_prompt, GenerationParams(mode="ar", max_tokens=4))
    progress = []
    while second.prefilled < len(long_prompt):
        before = len(first.output)
        engine.step()
        engine.step()
        progress.append(len(first.output) - before)
    # Every pair of ticks during the long prefill also decoded the running stream.
    assert len(progress) >= 4 and all(p > 0 for p in progress[:-1])


def test_queue_limits(model):
    local = open_local_engine(model, num_rows=1)
    engine = local.engine
    engine.scheduler.limits = Limits(max_running=1, max_queued=2, max_queued_tokens=1000)
    ids = local.tokenizer.encode("x y")
    for _ in range(3):  # one runs at the next tick, two wait
        engine.submit(ids, GenerationParams(max_tokens=4))
    with pytest.raises(QueueFull, match="2 requests waiting"):
        engine.submit(ids, GenerationParams(max_tokens=4))
    engine.scheduler.limits = Limits(max_running=1, max_queued=10, max_queued_tokens=5)
    with pytest.raises(QueueFull, match="prompt tokens"):
        engine.submit(ids * 3, GenerationParams(max_tokens=4))


def test_cancel_frees_kv_within_a_tick(model):
    local = open_local_engine(model, num_rows=2)
    engine = local.engine
    seqs = [
        engine.submit(local.tokenizer.encode(t), GenerationParams(max_tokens=200))
        for t in ("a", "b")
    ]
    while len(seqs[0].output) < 5:
        engine.step()
    store = engine.pipeline.runner.store
    assert seqs[0].seq_id in store
    engine.cancel(seqs[0])
    engine.step()
    assert seqs[0].seq_id not in store and seqs[0].finish_reason == "cancelled"
    assert seqs[1].seq_id in store


def test_autoregressive_look_ahead_keeps_tokens_and_samples(model):
    """AR micro-batches launch their next forward before the host reads the tokens; the
    output (greedy or sampled) is the same as without look-ahead, alone or batched."""
    reqs = [
        (
            "sample this",
            GenerationParams(mode="ar", temperature=0.8, top_k=20, seed=7, max_tokens=30),
        ),
        ("and this one", GenerationParams(mode="ar", max_tokens=25, stop_ids=(5,))),
    ]
    local = open_local_engine(model, num_rows=2)
    batched = run_all(local, reqs)
    alone = [run_all(open_local_engine(model), [r])[0] for r in reqs]
    no_ahead = open_local_engine(model, num_rows=2)
    no_ahead.engine._launch_ahead = lambda *args: False
    assert batched == alone == run_all(no_ahead, reqs)


def test_admission_by_kv_memory(model):
    """With a KV budget (from the workers' measured free memory), sequences wait until
    their worst-case KV fits, and one that can never fit is refused at once."""
    local = open_local_engine(model, num_rows=4)
    engine = local.engine
    engine.scheduler.limits.kv_tokens = 100
    ids = local.tokenizer.encode("hi")
    with pytest.raises(QueueFull, match="may need"):
        engine.submit(ids, GenerationParams(mode="ar", max_tokens=200))
    seqs = [engine.submit(ids, GenerationParams(mode="ar", max_tokens=40)) for _ in range(3)]
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 1  # 2 x (2 + 40 + 1) <= 100
    for _ in engine.stream(seqs):
        assert engine.scheduler.kv_in_use() <= 100
    assert all(s.finish_reason in ("length", "stop") for s in seqs)


def test_commits_of_a_failed_step_are_not_lost(model):
    """A sequence whose last tokens are known finishes without a forward; if a worker fails
    later in that same step, its final commit is kept for the recovery to deliver."""
    from coordinator.engine.pipeline import LocalPipeline

    local = open_local_engine(model, num_rows=8)
    engine = local.engine
    parts = engine.parts
    failed_once = []

    class Flaky(LocalPipeline):
        def collect(self):
            finished_now = [s for s in engine.scheduler.running if s.finished]
            if finished_now and not failed_once:
                failed_once.append(finished_now)
                raise RuntimeError("worker lost")
            return super().collect()

    engine.restart_on(Flaky(parts), 1)
    seqs = [
        engine.submit(
            local.tokenizer.encode(f"prompt {i} fox"), GenerationParams(max_tokens=12 + 3 * i)
        )
        for i in range(6)
    ]
    delivered = set()
    while engine.has_work:
        try:
            commits = engine.step()
        except RuntimeError:
            commits = engine.take_undelivered()  # what the engine loop does on a failure
            engine.restart_on(LocalPipeline(parts), 1)
        delivered |= {c.seq.seq_id for c in commits if c.seq.finished}
    assert failed_once, "the failure was never triggered"
    assert delivered == {s.seq_id for s in seqs}


def test_engine_loop_and_heartbeat_stop_and_join(model):
    """The service threads stop on request and can be joined (their stop events must not
    shadow threading.Thread internals)."""
    from coordinator.cluster.heartbeat import Heartbeat
    from coordinator.service.engine_loop import EngineLoop

    local = open_local_engine(model)
    threads = [EngineLoop(local.engine, local.tokenizer), Heartbeat(lambda: None, period_s=0.05)]
    for t in threads:
        t.start()
    for t in threads:
        t.stop()
        t.join(5)
        assert not t.is_alive()


def prefill_forwards(engine) -> int:
    return engine.forwards - engine.scheduler.decode_forwards


def decoding_engine(model, hold: int, batch: int = 8):
    """An engine with one AR stream decoding, and the prefill hold set."""
    local = open_local_engine(model, num_rows=8)
    engine = local.engine
    engine.scheduler.limits = Limits(max_running=8, prefill_hold=hold, prefill_batch=batch)
    params = GenerationParams(mode="ar", max_tokens=60)
    first = engine.submit(local.tokenizer.encode("running"), params)
    while not first.output:
        engine.step()
    return local, first


def test_prefill_hold_shares_one_forward_among_arrivals(model):
    """While a stream decodes, prompts arriving a step apart wait (up to prefill_hold decode
    steps) and are prefilled in one forward; tokens are the same as without the hold."""
    outputs = {}
    for hold in (4, 0):
        local, first = decoding_engine(model, hold)
        engine = local.engine
        params = GenerationParams(mode="ar", max_tokens=12)
        before = prefill_forwards(engine)
        late = []
        for text in ("one arrival", "another one"):
            late.append(engine.submit(local.tokenizer.encode(text), params))
            engine.step()
        if hold:
            assert all(s.prefilled == 0 for s in late), "held while the stream decodes"
            assert len(first.output) >= 3, "the stream decoded meanwhile"
        while any(s.prefilled < len(s.prompt) for s in late):
            engine.step()
        assert prefill_forwards(engine) - before == (1 if hold else 2)
        while engine.has_work:
            engine.step()
        outputs[hold] = [first.output, *(s.output for s in late)]
    assert outputs[4] == outputs[0]


def test_prefill_hold_never_waits_for_nothing(model):
    """A prompt is prefilled at once when nothing decodes, when prefill_batch prompts wait,
    and (for its next chunks) once its prefill has begun."""
    local = open_local_engine(model, num_rows=8)
    engine = local.engine
    engine.scheduler.limits = Limits(max_running=8, prefill_hold=100, prefill_batch=3)
    ar = GenerationParams(mode="ar", max_tokens=40)
    alone = engine.submit(local.tokenizer.encode("idle server"), ar)
    engine.step()
    assert alone.prefilled == len(alone.prompt), "an idle engine does not hold"
    while not alone.output:
        engine.step()
    params = GenerationParams(mode="ar", max_tokens=4)
    two = [engine.submit(local.tokenizer.encode(f"held {i}"), params) for i in range(2)]
    for _ in range(3):
        engine.step()
    assert all(s.prefilled == 0 for s in two), "two of three: held"
    third = engine.submit(local.tokenizer.encode("the third"), params)
    engine.step()
    engine.step()
    assert all(s.prefilled == len(s.prompt) for s in [*two, third]), "three: prefilled"


def test_prefill_hold_flags_are_validated(tmp_path):
    from common.errors import WedlmError
    from coordinator.service.serve_config import load_serve_config
    from coordinator.service.server_cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--prefill-hold", "0"])
    assert args.prefill_hold == 0 and args.prefill_batch == 8
    for flag, value in (("--prefill-hold", "-1"), ("--prefill-batch", "0")):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--model", "m", flag, value])
    config = tmp_path / "c.toml"
    config.write_text("prefill_hold = 0\nprefill_batch = 4\n")
    assert load_serve_config(config) == {"prefill_hold": 0, "prefill_batch": 4}
    config.write_text("prefill_hold = -2\n")
    with pytest.raises(WedlmError, match="prefill_hold must be 0 or more"):
        load_serve_config(config)
    config.write_text("prefill_batch = 0\n")
    with pytest.raises(WedlmError, match="prefill_batch must be positive"):
        load_serve_config(config)


def test_sequences_joining_a_decode_group_ride_the_look_ahead(model):
    """A prompt whose prefill ends joins its group's next look-ahead forward: arrivals cost
    one regular decode launch each (the one after their prefill), not two, and the tokens
    equal a run without look-ahead."""
    arrivals = ["one arrival", "a second one", "and a third"]
    outputs, regular = {}, {}
    for ahead in (True, False):
        local = open_local_engine(model, num_rows=4)
        engine = local.engine
        engine.scheduler.limits = Limits(max_running=4, prefill_hold=0)
        if not ahead:
            engine._launch_ahead = lambda *args: False
        launches: list[int] = []

        def counted(unit, plans, launch=engine._launch, launches=launches):
            launches.append(unit)
            launch(unit, plans)

        engine._launch = counted
        params = GenerationParams(mode="ar", max_tokens=30)
        seqs = [engine.submit(local.tokenizer.encode("the first stream"), params)]
        while len(seqs[0].output) < 3:
            engine.step()
        for text in arrivals:
            seqs.append(engine.submit(local.tokenizer.encode(text), params))
            for _ in range(4):
                engine.step()
        while engine.has_work:
            engine.step()
        outputs[ahead] = [s.output for s in seqs]
        regular[ahead] = sum(unit is not PREFILL for unit in launches)
    assert outputs[True] == outputs[False]
    assert regular[True] == 1 + len(arrivals)  # the first launch, then one per arrival
