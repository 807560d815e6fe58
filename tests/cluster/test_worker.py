"""`wedlm-worker` as the coordinator sees it: real processes on 127.0.0.1, real gRPC with
cluster authentication, real Bonjour on loopback. Parity with the in-process LayerRunner,
exact refusals that leave the worker serving, assignment, health and shutdown."""

from __future__ import annotations

import os
import queue
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.call_auth import (
    AUTH_KEY,
    MODEL_KEY,
    PROTOCOL_KEY,
    PROTOCOL_VERSION,
    auth_token,
    call_metadata,
)
from common.discovery_record import SERVICE_TYPE, WorkerAdvert
from common.layer_range import LayerRange
from common.layer_runner import LayerRunner
from common.model_config import load_model_config
from common.model_parts import load_model_parts
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, encode
from coordinator.cluster.worker_chain import forward_request
from tests.support.paths import REPO_ROOT

SECRET = "test-secret"
LINE = re.compile(r"^wedlm-worker (\S+) listening on (\S+):(\d+) layers (\S+) \(model (\w+)\)$")
ROOT = REPO_ROOT
S = grpc.StatusCode


class Worker:
    """A `wedlm-worker` process; `start` returns once it prints its listening line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in kill)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shard_worker.cli", *args],
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def wait_listening(self, timeout: float = 30.0) -> Worker:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().strip() if ready else ""
        m = LINE.match(line)
        assert m, f"no listening line (got {line!r}); stderr: {self.stderr()}"
        self.node_id, self.port, self.identity = m.group(1), int(m.group(3)), m.group(5)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.WorkerStub(self.channel)
        return self

    def stderr(self) -> str:
        self.errors.seek(0)
        return self.errors.read()

    def md(self, method: str, secret: str | None = SECRET, identity: str | None = None):
        return call_metadata(secret, f"/wedlm.v1.Worker/{method}", identity or self.identity)

    def info(self) -> pb.WorkerInfo:
        return self.stub.Info(pb.InfoRequest(), metadata=self.md("Info"), timeout=10)

    def forward(self, *requests: pb.ForwardRequest) -> list[pb.ForwardReply]:
        return list(self.stub.Forward(iter(requests), metadata=self.md("Forward"), timeout=30))

    def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if getattr(self, "channel", None):
            self.channel.close()
        self.errors.close()


def request(spec: RowsSpec, hidden: mx.array, batch_id: int = 0) -> pb.ForwardRequest:
    """The request the coordinator's pipeline would send (its hand-framed bytes, parsed
    back into a message that tests may alter)."""
    return pb.ForwardRequest.FromString(forward_request(batch_id, spec, encode(hidden)))


def spec_of(seq_ids, starts, widths, keeps, filled) -> RowsSpec:
    as_i64 = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
    return RowsSpec(list(seq_ids), as_i64(starts), as_i64(widths), np.array(filled), as_i64(keeps))


def fresh(seq_id: int, width: int = 3) -> tuple[RowsSpec, mx.array]:
    """A valid first forward of one new sequence."""
    spec = spec_of([seq_id], [0], [width], [width], np.ones((1, width), bool))
    return spec, mx.random.normal((1, width, 64), key=mx.random.key(seq_id))


def expect(code: grpc.StatusCode, call, *args, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, **kwargs)
        list(result) if hasattr(result, "__iter__") else result
    assert err.value.code() == code, err.value.details()
    return err.value.details()


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3", seed=3)


@pytest.fixture(scope="module")
def cluster() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def worker(model, cluster):
    """Layers 0-1 of the 2-layer model, the secret from the environment, advertised."""
    w = Worker(
        "--model", str(model), "--layers", "0-1", "--cluster", cluster, env={"WEDLM_SECRET": SECRET}
    )
    try:
        yield w.wait_listening()
    finally:
        w.kill()


@pytest.fixture(scope="module")
def unassigned(model):
    w = Worker("--model", str(model), "--secret", SECRET, "--no-bonjour")
    try:
        yield w.wait_listening()
    finally:
        w.kill()


def test_forward_matches_in_process_layers(worker, model):
    local = LayerRunner(load_model_parts(model, LayerRange(0, 1), with_ends=False))
    assert worker.identity == load_model_config(model).identity
    ids = [101, 102]
    # prefill of two prompts of different lengths (5 and 3), then a window with mask slots
    first = spec_of(ids, [0, 0], [5, 3], [5, 3], [[1] * 5, [1, 1, 1, 0, 0]])
    second = spec_of(ids, [5, 3], [4, 2], [1, 0], [[1, 0, 1, 0], [0, 1, 0, 0]])
    h1 = mx.random.normal((2, 5, 64), key=mx.random.key(1))
    h2 = mx.random.normal((2, 4, 64), key=mx.random.key(2))
    replies = worker.forward(request(first, h1, 7), request(second, h2, 8))
    assert [r.batch_id for r in replies] == [7, 8]
    for reply, spec, hidden in zip(replies, (first, second), (h1, h2), strict=True):
        want = local.forward(spec, hidden)
        got = decode(reply.hidden)
        assert got.dtype == mx.float32 and got.shape == want.shape
        assert np.array_equal(np.array(got), np.array(want))
        assert reply.compute_s > 0 and reply.queue_s >= 0
    info = worker.info()
    assert info.kv_sequences >= 2 and info.kv_bytes > 0
    released = worker.stub.Release(
        pb.ReleaseRequest(seq_ids=[*ids, 999_999]), metadata=worker.md("Release"), timeout=10
    )
    assert released.released == 2
    assert worker.info().kv_sequences == info.kv_sequences - 2


def test_half_precision_hidden_is_converted(worker):
    spec, hidden = fresh(201)
    (reply,) = worker.forward(request(spec, hidden.astype(mx.float16)))
    assert reply.hidden.dtype == pb.DTYPE_FLOAT16  # answered in the wire dtype it was sent
    assert decode(reply.hidden).shape == (1, 3, 64)


def test_reply_rows_carry_only_the_named_slots(worker, model):
    """The last worker returns only the slots the coordinator takes logits of: none for a
    prefill chunk, some of a window's; the KV of every slot is written all the same."""
    local = LayerRunner(load_model_parts(model, LayerRange(0, 1), with_ends=False))
    ids = [401, 402]
    first = spec_of(ids, [0, 0], [5, 3], [5, 3], [[1] * 5, [1, 1, 1, 0, 0]])
    second = spec_of(ids, [5, 3], [4, 2], [1, 0], [[1, 0, 1, 0], [0, 1, 0, 0]])
    h1 = mx.random.normal((2, 5, 64), key=mx.random.key(3))
    h2 = mx.random.normal((2, 4, 64), key=mx.random.key(4))
    none = np.zeros((2, 0), np.int32)
    some = np.array([[3, 1], [1, 0]], np.int32)
    requests = [
        pb.ForwardRequest.FromString(forward_request(1, first, encode(h1), none)),
        pb.ForwardRequest.FromString(forward_request(2, second, encode(h2), some)),
    ]
    replies = worker.forward(*requests)
    assert decode(replies[0].hidden).shape == (2, 0, 64)
    local.forward(first, h1)
    want = np.take_along_axis(np.array(local.forward(second, h2)), some[:, :, None], axis=1)
    assert np.array_equal(np.array(decode(replies[1].hidden)), want)
    # every slot's KV was written as without a selection: a later forward agrees
    third = spec_of(ids, [6, 3], [1, 1], [1, 1], [[1], [1]])
    h3 = mx.random.normal((2, 1, 64), key=mx.random.key(5))
    (reply,) = worker.forward(request(third, h3))
    assert np.array_equal(np.array(decode(reply.hidden)), np.array(local.forward(third, h3)))

    def selecting(per_row: int, slots: list[int]) -> pb.ForwardRequest:
        spec, hidden = fresh(410)
        req = request(spec, hidden)
        req.reply_rows.per_row = per_row
        req.reply_rows.slots.extend(slots)
        return req

    for per_row, slots, why in [
        (4, [0, 1, 2, 3], "the window has only 3 slots"),
        (2, [0], "expected 1×2 = 2"),
        (1, [3], "in [0, 3)"),
        (1, [-1], "in [0, 3)"),
    ]:
        details = expect(S.INVALID_ARGUMENT, worker.forward, selecting(per_row, slots))
        assert why in details, details
    (reply,) = worker.forward(selecting(2, [2, 0]))
    assert decode(reply.hidden).shape == (1, 2, 64)


def _bad_metadata(
    worker: Worker, protocol: str = "", model: str | None = None, auth=True, method="Info"
):
    md = [(PROTOCOL_KEY, protocol or str(PROTOCOL_VERSION)), (MODEL_KEY, model or worker.identity)]
    return md + ([(AUTH_KEY, auth_token(SECRET, f"/wedlm.v1.Worker/{method}"))] if auth else [])


def test_refused_calls_leave_the_worker_serving(worker):
    info = worker.stub.Info
    expect(S.UNAUTHENTICATED, info, pb.InfoRequest(), metadata=worker.md("Info", "wrong"))
    expect(S.UNAUTHENTICATED, info, pb.InfoRequest(), metadata=_bad_metadata(worker, auth=False))
    expect(S.FAILED_PRECONDITION, info, pb.InfoRequest(), metadata=_bad_metadata(worker, "99"))
    expect(S.FAILED_PRECONDITION, info, pb.InfoRequest(), metadata=_bad_metadata(worker, model="x"))
    assert worker.info().has_layers

    spec, hidden = fresh(301)
    good = request(spec, hidden)
    cases: list[tuple[grpc.StatusCode, pb.ForwardRequest]] = []
    bad = pb.ForwardRequest()
    bad.CopyFrom(good)
    bad.hidden.shape[:] = [1, 3, 65]
    cases.append((S.INVALID_ARGUMENT, bad))  # wrong hidden shape
    bad = pb.ForwardRequest()
    bad.CopyFrom(good)
    bad.hidden.data = bad.hidden.data[:-4]
    cases.append((S.INVALID_ARGUMENT, bad))  # wrong byte count
    bad = pb.ForwardRequest()
    bad.CopyFrom(good)
    bad.hidden.dtype = 9
    cases.append((S.INVALID_ARGUMENT, bad))  # unknown dtype
    bad = pb.ForwardRequest()
    bad.CopyFrom(good)
    bad.widths.append(3)
    cases.append((S.INVALID_ARGUMENT, bad))  # array lengths differ
    unknown = spec_of([302], [4], [3], [3], np.ones((1, 3), bool))
    cases.append((S.NOT_FOUND, request(unknown, hidden)))
    past = spec_of([303], [510], [3], [3], np.ones((1, 3), bool))
    cases.append((S.OUT_OF_RANGE, request(past, hidden)))

    # one long-lived stream keeps answering while other streams are refused
    sent: queue.Queue = queue.Queue()
    stream = worker.stub.Forward(iter(sent.get, None), metadata=worker.md("Forward"), timeout=60)
    sent.put(good)
    assert next(stream).hidden.shape == [1, 3, 64]
    for n, (code, req) in enumerate(cases):
        expect(code, worker.forward, req)
        s, h = fresh(310 + n)
        assert len(worker.forward(request(s, h))) == 1
    # 301 now holds 3 KV rows: a request that says otherwise is refused
    stale = spec_of([301], [2], [3], [3], np.ones((1, 3), bool))
    details = expect(S.FAILED_PRECONDITION, worker.forward, request(stale, hidden))
    assert "3 KV rows" in details
    later = spec_of([301], [3], [2], [1], np.ones((1, 2), bool))
    sent.put(request(later, hidden[:, :2]))
    assert next(stream).hidden.shape == [1, 2, 64]
    sent.put(None)
    assert list(stream) == []
    assert worker.info().kv_sequences >= 1


def _relay(worker: Worker, requests, metadata):
    return worker.stub.Relay(iter(requests), metadata=metadata, timeout=30)


def _route(worker: Worker, epoch: int, next_stage: str = "", prev_stage: str = ""):
    request = pb.RouteRequest(plan_epoch=epoch, next_stage=next_stage, prev_stage=prev_stage)
    return worker.stub.Route(request, metadata=worker.md("Route"), timeout=10)


def test_relays_need_credentials_and_the_current_plan(worker, model):
    """Relay (protocol 3) is checked like every call: no credentials, a wrong secret or a
    replayed token are refused and logged, and so is a relay to a stage the plan does not
    feed from a predecessor, or one of another plan. The worker keeps serving; a valid
    relay's output comes back on the coordinator's stream (this stage is last)."""
    spec, hidden = fresh(4401)
    good = request(spec, hidden, batch_id=9)
    expect(S.UNAUTHENTICATED, _relay, worker, [good], _bad_metadata(worker, auth=False))
    expect(S.UNAUTHENTICATED, _relay, worker, [good], worker.md("Relay", "wrong"))
    replayed = worker.md("Relay")
    details = expect(S.FAILED_PRECONDITION, _relay, worker, [good], replayed)
    assert "the coordinator feeds it" in details  # no predecessor under plan 0
    assert "replayed" in expect(S.UNAUTHENTICATED, _relay, worker, [good], replayed)
    old = _bad_metadata(worker, "2", method="Relay")  # a peer of protocol 2
    assert "same wedlm-cluster version" in expect(
        S.FAILED_PRECONDITION, _relay, worker, [good], old
    )
    assert worker.info().has_layers
    log = worker.stderr()
    assert "refused /wedlm.v1.Worker/Relay" in log and "replayed" in log

    assert _route(worker, 7, prev_stage="127.0.0.1:1").plan_epoch == 7
    try:
        first: queue.Queue = queue.Queue()
        replies = worker.stub.Forward(iter(first.get, None), metadata=worker.md("Forward"))
        stale = request(spec, hidden, batch_id=8)
        stale.plan_epoch = 6
        assert "plan 6" in expect(
            S.FAILED_PRECONDITION, _relay, worker, [stale], worker.md("Relay")
        )
        expect(S.FAILED_PRECONDITION, lambda: next(replies))  # reported to the coordinator too
        first.put(None)
        sent: queue.Queue = queue.Queue()
        replies = worker.stub.Forward(iter(sent.get, None), metadata=worker.md("Forward"))
        good.plan_epoch = 7
        assert _relay(worker, [good], worker.md("Relay")).received == 1
        reply = next(replies)
        assert reply.batch_id == 9 and list(reply.stage_compute_s) == [reply.compute_s]
        local = LayerRunner(load_model_parts(model, LayerRange(0, 1), with_ends=False))
        want = local.forward(spec, hidden)
        np.testing.assert_allclose(np.array(decode(reply.hidden)), np.array(want), atol=1e-5)
        sent.put(None)
    finally:
        _route(worker, 0)
        worker.forward(request(*fresh(4402)))  # back on plan 0, serving as before


def test_fixed_range_refuses_another_assignment(worker):
    details = expect(
        S.FAILED_PRECONDITION,
        worker.stub.Assign,
        pb.AssignRequest(layer_start=0, layer_end=0),
        metadata=worker.md("Assign"),
    )
    assert "--layers 0-1" in details
    info = worker.info()
    assert info.fixed_range and info.has_layers and (info.layer_start, info.layer_end) == (0, 1)


def test_layers_past_the_model_exit_1(model):
    done = subprocess.run(
        [sys.executable, "-m", "shard_worker.cli", "--model", str(model), "--layers", "0-5"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == (
        "wedlm-worker: error: --layers 0-5 is past the model's 2 layers (0-1)"
    )


def test_unassigned_worker_waits_for_assign(unassigned):
    w = unassigned
    before = w.info()
    assert not before.has_layers and not before.fixed_range and before.num_layers == 2
    assert before.layer_bytes > 0 and before.kv_bytes_per_token == 2 * 2 * 16 * 4
    assert before.hidden_dtype == "float32" and before.memory_total >= before.memory_available > 0
    assert w.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    spec, hidden = fresh(401)
    assert "Assign" in expect(S.FAILED_PRECONDITION, w.forward, request(spec, hidden))
    assign = w.stub.Assign
    expect(
        S.OUT_OF_RANGE,
        assign,
        pb.AssignRequest(layer_start=0, layer_end=2),
        metadata=w.md("Assign"),
    )
    after = assign(
        pb.AssignRequest(layer_start=0, layer_end=1), metadata=w.md("Assign"), timeout=30
    )
    assert after.has_layers and (after.layer_start, after.layer_end) == (0, 1)
    assert after.layer_bytes == before.layer_bytes  # the estimate from the checkpoint is exact
    assert after.kv_bytes_per_token == 2 * before.kv_bytes_per_token
    assert w.health() == health_pb2.HealthCheckResponse.SERVING
    assert len(w.forward(request(spec, hidden))) == 1


def _browser(found: dict[str, WorkerAdvert], removed: set[str]):
    from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)

    def on_change(zeroconf, service_type, name, state_change):
        if state_change is ServiceStateChange.Removed:
            removed.add(name)
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is not None:
            found[name] = (WorkerAdvert.from_txt(info.properties), info.port)

    return zc, ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_bonjour_advertisement(worker, cluster):
    found: dict = {}
    zc, browser = _browser(found, set())
    try:
        mine = lambda: [v for v in found.values() if v[0].node_id == worker.node_id]  # noqa: E731
        assert _wait_for(mine), f"not advertised; saw {found}"
        advert, port = mine()[0]
        assert port == worker.port
        assert advert.cluster == cluster and advert.protocol == PROTOCOL_VERSION
        assert advert.layers == "0-1" and advert.model == worker.identity
        assert advert.memory_total >= advert.memory_available > 0
    finally:
        browser.cancel()
        zc.close()


def test_sigterm_withdraws_the_advertisement_and_exits_0(model):
    w = Worker("--model", str(model), "--cluster", f"bye-{uuid.uuid4().hex[:6]}")
    found: dict = {}
    removed: set = set()
    zc, browser = _browser(found, removed)
    try:
        w.wait_listening()
        name = f"{w.node_id}.{SERVICE_TYPE}"
        assert _wait_for(lambda: name in found), f"not advertised; saw {found}"
        assert found[name][0].layers == ""
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(15) == 0, w.stderr()
        assert _wait_for(lambda: name in removed, 5.0)
    finally:
        browser.cancel()
        zc.close()
        w.kill()
