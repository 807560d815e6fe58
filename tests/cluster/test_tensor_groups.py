"""Tensor groups without a cluster (issue 31): which models split N ways and why not,
how a group spec is checked, how the coordinator forms groups from probed workers (and
what it says when it cannot), a group's room in the layer plan, the wire to a group
process, and a real worker's answer to a bad group in Assign (over real gRPC)."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from common.model_config import load_model_config
from common.proto_gen import wedlm_pb2 as pb
from common.rows_spec import RowsSpec
from common.tensor_group.spec import GroupSpec, available_backends, shard_problem
from common.tensor_group.wire import pack, spec_message, spec_of, unpack
from coordinator.cluster.cluster_setup import (
    LOCAL,
    LocalMember,
    WorkerEntry,
    local_entry,
    plan_stages,
)
from coordinator.cluster.tensor_groups import form_groups
from coordinator.cluster.worker_link import WorkerCallError, WorkerLink
from tests.support.cluster_harness import cluster_name, start_worker


@pytest.fixture(scope="module")
def config(checkpoint_dir):
    return load_model_config(checkpoint_dir("qwen3", seed=5, num_hidden_layers=4))


def test_shard_problem_names_what_does_not_divide(config):
    assert shard_problem(config, 2) is None  # 4 heads, 2 KV heads, MLP 128
    assert shard_problem(config, 3) == "its 4 attention heads do not divide by 3"
    four = dataclasses.replace(config, raw={**config.raw, "num_key_value_heads": 1})
    assert shard_problem(four, 2) == "its 1 key/value heads do not divide by 2"


def test_shard_problem_for_models_without_a_split(config):
    no_shard = dataclasses.replace(config, family="gemma3_text")
    assert shard_problem(no_shard, 2) == (
        "gemma3_text cannot be split across a tensor group: mlx-lm has no shard for it; use stages"
    )
    diffusion = dataclasses.replace(config, model_type="diffusion_gemma")
    if diffusion.diffusion:
        assert "diffusion model" in shard_problem(diffusion, 2)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (GroupSpec(0, 1, ["a:1"]), "at least 2 members"),
        (GroupSpec(2, 2, ["a:1", "b:2"]), "rank 2 is outside a group of 2"),
        (GroupSpec(0, 2, ["a:1"]), "1 hosts for a group of 2"),
        (GroupSpec(0, 2, ["a:1", "b"]), "group host 'b' is not HOST:PORT"),
        (GroupSpec(0, 2, ["a:1", "b:2"], backend="mpi"), "unknown group backend 'mpi'"),
    ],
)
def test_group_spec_check(spec, problem):
    with pytest.raises(ValueError, match=problem):
        spec.check()


def test_ring_is_always_there():
    assert "ring" in available_backends()


def _worker(address: str, backends=("ring",), fixed: bool = False, memory: int = 1 << 30):
    info = pb.WorkerInfo(
        group_port=7000 + int(address.rsplit(":", 1)[1]),
        group_backends=list(backends),
        fixed_range=fixed,
        memory_available=memory,
    )
    return WorkerEntry(address, "static", "serving", info=info)


def test_groups_form_in_order_and_the_rest_stays_alone(config):
    entries = [_worker(f"127.0.0.1:{p}") for p in (1, 2, 3)]
    groups, note = form_groups(entries, config, 2)
    assert [g.addresses for g in groups] == [["127.0.0.1:1", "127.0.0.1:2"]]
    assert groups[0].hosts == ["127.0.0.1:7001", "127.0.0.1:7002"]
    assert groups[0].backend == "ring"
    assert "tensor group 127.0.0.1:1 + 127.0.0.1:2 (tp=2, ring)" in note
    assert "alone (no group of 2 with a shared backend): 127.0.0.1:3" in note


def test_fixed_workers_and_missing_backends_stay_alone(config):
    entries = [
        _worker("127.0.0.1:1", fixed=True),
        _worker("127.0.0.1:2", backends=()),
        _worker("127.0.0.1:3"),
    ]
    groups, note = form_groups(entries, config, 2)
    assert groups == []  # 2 and 3 share no backend; 1 was started with --layers
    assert "alone" in note and "127.0.0.1:2" in note and "127.0.0.1:3" in note


def test_nccl_is_preferred_when_every_member_has_it(config):
    entries = [_worker(f"127.0.0.1:{p}", backends=("ring", "nccl")) for p in (1, 2)]
    groups, _ = form_groups(entries, config, 2)
    assert groups[0].backend == "nccl"


def test_heads_that_do_not_divide_plan_a_pipeline(config):
    groups, note = form_groups([_worker(f"127.0.0.1:{p}") for p in (1, 2, 3)], config, 3)
    assert (
        groups == []
        and note == "--tp 3: a pipeline, because its 4 attention heads do not divide by 3"
    )


def test_the_coordinator_leads_the_first_group(config):
    me = local_entry(LocalMember(1 << 30, None, 7100, ("ring",)))
    entries = [_worker(f"127.0.0.1:{p}") for p in (1, 2, 3)]
    groups, _ = form_groups(entries, config, 2, me)
    assert [g.addresses for g in groups] == [[LOCAL, "127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"]]
    assert groups[0].hosts[0] == "127.0.0.1:7100"  # its address as the workers reach it


def test_a_group_plans_as_one_stage_with_its_members_room(config):
    """Two members of 1 GiB each hold what one member of 2 GiB would: the group's room
    is N times its tightest member's."""
    entries = [_worker(f"127.0.0.1:{p}") for p in (1, 2)]
    groups, _ = form_groups(entries, config, 2)
    for m in groups[0].members:
        m.group = groups[0]
    plan = plan_stages(entries, config, 64, None)
    assert list(plan) == ["127.0.0.1:1"] and len(plan["127.0.0.1:1"]) == 4


def test_a_forward_crosses_the_wire_unchanged():
    spec = RowsSpec(
        seq_ids=[3, 9],
        starts=np.array([0, 5]),
        widths=np.array([4, 2]),
        filled=np.array([[1, 1, 0, 1], [1, 0, 0, 0]], bool),
        keeps=np.array([4, 1]),
        forks=[(9, 2, 5)],
    )
    back = spec_of(unpack(pack(spec_message(spec))))
    assert back.seq_ids == [3, 9] and back.forks == [(9, 2, 5)] and back.canvas is None
    for name in ("starts", "widths", "filled", "keeps"):
        np.testing.assert_array_equal(getattr(back, name), getattr(spec, name))


def test_a_worker_refuses_a_bad_group(checkpoint_dir):
    model = checkpoint_dir("qwen3", seed=5, num_hidden_layers=4)
    identity = load_model_config(model).identity
    worker, address = start_worker(model, cluster_name(), "--no-bonjour")
    link = WorkerLink(address, None, identity)
    try:
        info = link.info()
        assert info.group_port > 0 and "ring" in info.group_backends
        cases = [
            (GroupSpec(1, 2, ["127.0.0.1:1"]), "INVALID_ARGUMENT", "1 hosts for a group of 2"),
            (GroupSpec(0, 2, ["a:1", "b:2"], "nccl"), "FAILED_PRECONDITION", "no nccl backend"),
            (GroupSpec(0, 3, ["a:1", "b:2", "c:3"]), "FAILED_PRECONDITION", "do not divide by 3"),
        ]
        for spec, code, words in cases:
            if spec.backend == "nccl" and "nccl" in info.group_backends:
                continue
            with pytest.raises(WorkerCallError) as err:
                link.assign(0, 3, group=spec)
            assert err.value.code == getattr(grpc.StatusCode, code) and words in str(err.value)
        assert not link.info().has_layers or link.info().group_size == 0  # nothing changed
    finally:
        link.close()
        worker.stop()


def test_forwards_in_flight_and_a_release_between_them(config):
    """A group's forwards may be launched before the earlier ones are answered (the
    coordinator prepares its next micro-batch meanwhile), and a release sent while they run
    waits for them: the answers come in order and equal forwards run one at a time."""
    import threading

    import mlx.core as mx

    from common.free_port import free_port
    from common.kv_format import FULL
    from common.layer_range import LayerRange
    from common.tensor_codec import decode, wire_form
    from common.tensor_group.member import GroupMember
    from common.wire_frames import WireTensor

    hosts = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    members: list = [None, None]

    def start(rank: int) -> None:
        members[rank] = GroupMember(
            config.path, LayerRange(0, config.num_layers - 1), FULL, GroupSpec(rank, 2, hosts)
        )

    threads = [threading.Thread(target=start, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    leader = members[0]
    try:
        rng = np.random.default_rng(3)

        def spec(seq: int, start: int, width: int) -> RowsSpec:
            return RowsSpec([seq], np.array([start]), np.array([width]),
                            np.ones((1, width), bool), np.array([width]))  # fmt: skip

        def hidden(width: int) -> WireTensor:
            x = mx.array(rng.standard_normal((1, width, config.hidden_size), dtype=np.float32))
            wire, raw = wire_form(x)
            host = np.array(raw)
            return WireTensor(wire, host.shape, host.tobytes())

        work = [(spec(1, 0, 5), hidden(5)), (spec(2, 0, 3), hidden(3)),
                (spec(1, 5, 1), hidden(1))]  # fmt: skip
        one_at_a_time = []
        for s, x in work:
            leader.launch(s, x, None)
            one_at_a_time.append(np.array(decode(leader.finish()[0])))
        assert leader.release([1, 2]) == 2
        for s, x in work:  # the same forwards, all in flight, a release among them
            leader.launch(dataclasses.replace(s, seq_ids=[s.seq_ids[0] + 10]), x, None)
        assert leader.release([99]) == 0
        in_flight = [np.array(decode(leader.finish()[0])) for _ in work]
        for a, b in zip(one_at_a_time, in_flight, strict=True):
            assert a.shape == b.shape and np.array_equal(a, b)
        assert leader.release([11, 12]) == 2
    finally:
        for m in members:
            if m is not None:
                m.stop()
