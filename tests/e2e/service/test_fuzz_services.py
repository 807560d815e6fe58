"""Fuzzing every gRPC method of a real `wedlm-worker` and `wedlm-coordinator` with hypothesis.

Random messages (built from the descriptors, or domain-aware ones that pass the first checks),
one-field mutations of valid requests, raw garbage as the serialized request and bad
credentials must each end in a valid reply or a precise status: never UNKNOWN or INTERNAL
(an unhandled exception in a servicer), never a hang, and both processes keep serving."""

from __future__ import annotations

import contextlib
import functools
import os
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from common.call_auth import AUTH_KEY, MODEL_KEY, PROTOCOL_KEY, PROTOCOL_VERSION, auth_token
from common.model_config import load_model_config
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.tensor_group.spec import GroupSpec, rdma_rows
from tests.support import fuzz_messages as fm
from tests.support.cluster_harness import Proc, cluster_name, start_coordinator, start_worker

SECRET = "fuzz-secret"
PLAN_EPOCH = 1  # the fuzz cluster's one plan: the worker refuses micro-batches of others
CALL_S = 10.0  # every call's deadline: reaching it means a hang
S = grpc.StatusCode
# Refusals a servicer may answer with (UNAUTHENTICATED only for bad credentials).
REFUSALS = {
    S.INVALID_ARGUMENT,
    S.OUT_OF_RANGE,
    S.NOT_FOUND,
    S.FAILED_PRECONDITION,
    S.RESOURCE_EXHAUSTED,
    S.UNAVAILABLE,
}
# Request bytes that do not parse are answered INVALID_ARGUMENT, "malformed <Message>: ...".
WORKER_METHODS = ("Forward", "Release", "Assign", "Info")
MODEL_SOURCE_METHODS = ("LayerManifest", "FetchLayer")  # the coordinator's, for workers
COORDINATOR_METHODS = (
    "Generate",
    "Submit",
    "GetJob",
    "WaitJob",
    "CancelJob",
    "ClusterStatus",
    "ModelInfo",
)
FINISH_REASONS = {"stop", "length", "cancelled", "deadline"}  # "error" is a failed job

# WEDLM_FUZZ_SCALE=10 fuzzes ten times as long (the first examples stay the same).
SCALE = float(os.environ.get("WEDLM_FUZZ_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


FUZZ = settings(
    max_examples=examples(40),
    deadline=None,
    derandomize=True,  # the same examples on every run
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FEW = settings(FUZZ, max_examples=examples(25))


# ---- the cluster -----------------------------------------------------------------------
@dataclass
class Cluster:
    worker: Proc
    worker_address: str
    coordinator: Proc
    address: str
    identity: str
    worker_channel: grpc.Channel
    channel: grpc.Channel
    model: Path

    @property
    def worker_stub(self) -> pb_grpc.WorkerStub:
        return pb_grpc.WorkerStub(self.worker_channel)

    @property
    def stub(self) -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(self.channel)

    def md(self, method: str, service: str = "Worker") -> list[tuple[str, str]]:
        """Proper credentials for one cluster call (a token is good for one call only)."""
        return [
            (PROTOCOL_KEY, str(PROTOCOL_VERSION)),
            (MODEL_KEY, self.identity),
            (AUTH_KEY, auth_token(SECRET, f"/wedlm.v1.{service}/{method}")),
        ]

    def logs(self, since: tuple[int, int] = (0, 0)) -> str:
        time.sleep(0.2)  # let the readers catch the server's last lines
        worker = "".join(self.worker.log[since[0] :])[-4000:]
        coordinator = "".join(self.coordinator.log[since[1] :])[-4000:]
        return f"\n--- worker output:\n{worker}\n--- coordinator output:\n{coordinator}"

    def mark(self) -> tuple[int, int]:
        return len(self.worker.log), len(self.coordinator.log)

    def assert_alive(self) -> None:
        for name, proc in (("worker", self.worker), ("coordinator", self.coordinator)):
            assert proc.popen.poll() is None, f"the {name} exited{self.logs()}"

    def assert_serving(self) -> None:
        """Both processes alive, the worker answers Info, the coordinator generates."""
        self.assert_alive()
        info = self.worker_stub.Info(pb.InfoRequest(), metadata=self.md("Info"), timeout=CALL_S)
        assert info.has_layers and (info.layer_start, info.layer_end) == (0, 1)
        request = pb.GenerateRequest(text="still serving?", max_tokens=3)
        events = list(self.stub.Generate(request, timeout=30))
        final = events[-1].final
        assert events[-1].HasField("final") and final.finish_reason in ("stop", "length"), final
        assert 1 <= len(final.tokens) <= 3
        self.assert_alive()


@pytest.fixture(scope="module")
def cluster(checkpoint_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model: Path = checkpoint_dir("qwen3", seed=11)  # 2 layers, hidden 64, vocab 320
    name = cluster_name()
    procs: list[Proc] = []
    try:
        worker, worker_address = start_worker(
            model, name, "--layers", "0-1", "--no-bonjour", "--secret", SECRET
        )
        procs.append(worker)
        coordinator, address = start_coordinator(
            model,
            name,
            "--no-bonjour",
            "--worker",
            worker_address,
            "--expect",
            "1",
            "--secret",
            SECRET,
            "--max-running",
            "2",
            "--state-dir",  # accepted jobs go through SQLite, as by default
            str(tmp_path_factory.mktemp("fuzz-jobs")),
        )
        procs.append(coordinator)
        coordinator.expect("serving")
        with (
            grpc.insecure_channel(worker_address) as worker_channel,
            grpc.insecure_channel(address) as channel,
        ):
            c = Cluster(
                worker,
                worker_address,
                coordinator,
                address,
                load_model_config(model).identity,
                worker_channel,
                channel,
                model,
            )
            c.assert_serving()
            info = c.worker_stub.Info(pb.InfoRequest(), metadata=c.md("Info"), timeout=CALL_S)
            assert info.plan_epoch == PLAN_EPOCH
            yield c
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def serving(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, checked to still serve after the test's examples, and to have logged
    no traceback (an exception a status did not show, e.g. in a background thread)."""
    since = cluster.mark()
    yield cluster
    cluster.assert_serving()
    logs = cluster.logs(since)
    assert not unexpected_errors(logs), logs


def unexpected_errors(log: str) -> list[str]:
    """The exceptions a log shows (an unparseable request must not log one)."""
    found, lines = [], log.splitlines()
    for n, line in enumerate(lines):
        if "unexpected error" in line:
            found.append(line)
        if line.startswith("Traceback"):  # its exception is the next unindented line
            last = next((x for x in lines[n + 1 :] if x and not x.startswith(" ")), "")
            found.append(last)
    return found


# ---- calls -----------------------------------------------------------------------------
def refused(
    cluster: Cluster, what: str, error: grpc.RpcError, allowed: set[S], since: tuple[int, int]
) -> S:
    """The status of a failed call, which must be one of `allowed`."""
    code = error.code()
    event(f"{code.name}: {error.details()[:50]}")  # shown by --hypothesis-show-statistics
    assert code in allowed, (
        f"{what} answered {code.name}: {error.details()!r} "
        f"(allowed: {sorted(c.name for c in allowed)}){cluster.logs(since)}"
    )
    return code


def call(
    cluster: Cluster, what: str, fn: Callable[[], Any], allowed: set[S]
) -> tuple[Any, S | None]:
    """(reply, None) or (None, status); any other status or exception fails."""
    since = cluster.mark()
    try:
        reply = fn()
        event("reply")
        return reply, None
    except grpc.RpcError as e:
        return None, refused(cluster, what, e, allowed, since)


def stream_call(
    cluster: Cluster, what: str, responses: Iterator[Any], allowed: set[S], limit: int = 0
) -> tuple[list[Any], S | None]:
    """Read a server stream to its end (or `limit` messages, then cancel it): the messages
    received and the status it ended with (None: it ended well, or we cancelled it)."""
    since = cluster.mark()
    got: list[Any] = []
    try:
        for message in responses:
            got.append(message)
            if limit and len(got) >= limit:
                responses.cancel()
                break
        event(f"{len(got)} messages, then {'cancelled' if limit and len(got) >= limit else 'OK'}")
        return got, None
    except grpc.RpcError as e:
        return got, refused(cluster, what, e, allowed, since)


def raw_method(channel: grpc.Channel, service: str, method: str) -> Callable[..., Any]:
    """A call of `method` whose requests and replies are bytes, not messages."""
    path = f"/wedlm.v1.{service}/{method}"
    kinds = {"Forward": channel.stream_stream, "Generate": channel.unary_stream}
    make = kinds.get(method, channel.unary_unary)
    return make(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def check_raw_refusal(cluster: Cluster, what: str, error: grpc.RpcError, since, extra: set[S]):
    """Garbage that does not parse gets INVALID_ARGUMENT naming the message; everything
    else must be a precise status too."""
    if error.code() == S.INVALID_ARGUMENT and (error.details() or "").startswith("malformed "):
        event("unparseable")
        return
    refused(cluster, what, error, REFUSALS | extra, since)


# ---- worker credentials ----------------------------------------------------------------
PRINTABLE = st.text(alphabet=string.printable.strip() + " ", max_size=40)
# Kinds of bad metadata and the status each must get.
BAD_AUTH: dict[str, S] = {
    "none": S.UNAUTHENTICATED,
    "wrong-secret": S.UNAUTHENTICATED,
    "other-method": S.UNAUTHENTICATED,
    "expired": S.UNAUTHENTICATED,
    "future": S.UNAUTHENTICATED,
    "replayed": S.UNAUTHENTICATED,
    "garbage": S.UNAUTHENTICATED,
    "no-protocol": S.FAILED_PRECONDITION,
    "old-protocol": S.FAILED_PRECONDITION,
    "other-model": S.FAILED_PRECONDITION,
}
STAMPS = st.one_of(
    st.integers(-(10**400), 10**400).map(str),
    st.floats(allow_nan=True).map(str),
    PRINTABLE,
)
GARBAGE_TOKENS = st.one_of(
    PRINTABLE,
    st.tuples(STAMPS, PRINTABLE, PRINTABLE).map(":".join),
    st.tuples(st.just(None), PRINTABLE, PRINTABLE),  # a current stamp, a garbage signature
)
AUTH_KINDS = st.one_of(
    st.just("ok"),
    st.just("ok"),
    st.just("ok"),
    st.sampled_from(sorted(BAD_AUTH)),
)


@dataclass
class Credentials:
    kind: str
    token: Any = None  # for "garbage"

    def metadata(
        self, cluster: Cluster, method: str, service: str = "Worker"
    ) -> list[tuple[str, str]]:
        path = f"/wedlm.v1.{service}/{method}"
        md = dict(cluster.md(method, service))
        now = time.time()
        match self.kind:
            case "none":
                del md[AUTH_KEY]
            case "wrong-secret":
                md[AUTH_KEY] = auth_token("not-" + SECRET, path)
            case "other-method":
                methods = MODEL_SOURCE_METHODS if service == "ModelSource" else WORKER_METHODS
                other = next(m for m in methods if m != method)
                md[AUTH_KEY] = auth_token(SECRET, f"/wedlm.v1.{service}/{other}")
            case "expired":
                md[AUTH_KEY] = auth_token(SECRET, path, now=now - 3600)
            case "future":
                md[AUTH_KEY] = auth_token(SECRET, path, now=now + 3600)
            case "replayed":  # a token that a call of this method has already used
                md[AUTH_KEY] = auth_token(SECRET, path)
                spend(cluster, method, list(md.items()))
            case "garbage":
                token = self.token
                if isinstance(token, tuple):
                    token = f"{int(now)}:{token[1]}:{token[2]}"
                md[AUTH_KEY] = token
            case "no-protocol":
                del md[PROTOCOL_KEY]
            case "old-protocol":
                md[PROTOCOL_KEY] = "0"
            case "other-model":
                md[MODEL_KEY] = "f" * 16
        return list(md.items())

    @property
    def expected(self) -> S | None:
        """The status these credentials must get (None: the method's own answer)."""
        return BAD_AUTH.get(self.kind)


def spend(cluster: Cluster, method: str, md: list[tuple[str, str]]) -> None:
    """A harmless accepted call, which uses up the token in `md`."""
    stub = cluster.worker_stub
    source = pb_grpc.ModelSourceStub(cluster.channel)
    if method == "LayerManifest":
        source.LayerManifest(pb.LayerManifestRequest(layers=[0]), metadata=md, timeout=CALL_S)
    elif method == "FetchLayer":
        list(source.FetchLayer(pb.FetchLayerRequest(layer=1), metadata=md, timeout=CALL_S))
    elif method == "Forward":
        assert list(stub.Forward(iter([]), metadata=md, timeout=CALL_S)) == []
    elif method == "Release":
        stub.Release(pb.ReleaseRequest(), metadata=md, timeout=CALL_S)
    elif method == "Relay":  # refused after the credentials: the coordinator feeds it
        with pytest.raises(grpc.RpcError) as err:
            stub.Relay(iter([]), metadata=md, timeout=CALL_S)
        assert err.value.code() == S.FAILED_PRECONDITION
    elif method == "Route":  # refused after the credentials were checked
        with pytest.raises(grpc.RpcError) as err:
            stub.Route(pb.RouteRequest(next_stage="no port"), metadata=md, timeout=CALL_S)
        assert err.value.code() == S.INVALID_ARGUMENT
    elif method == "Assign":  # refused after the credentials were checked
        with pytest.raises(grpc.RpcError) as err:
            stub.Assign(pb.AssignRequest(layer_start=-1), metadata=md, timeout=CALL_S)
        assert err.value.code() == S.INVALID_ARGUMENT
    else:
        stub.Info(pb.InfoRequest(), metadata=md, timeout=CALL_S)


@st.composite
def credentials(draw: st.DrawFn, kinds: st.SearchStrategy[str] = AUTH_KINDS) -> Credentials:
    kind = draw(kinds)
    return Credentials(kind, draw(GARBAGE_TOKENS) if kind == "garbage" else None)


def allowed_for(creds: Credentials, method_allows: set[S]) -> set[S]:
    return {creds.expected} if creds.expected else method_allows


def release(cluster: Cluster, seq_ids: list[int]) -> None:
    """Drop what an example left on the worker, so examples stay independent."""
    if seq_ids:
        request = pb.ReleaseRequest(seq_ids=seq_ids)
        cluster.worker_stub.Release(request, metadata=cluster.md("Release"), timeout=CALL_S)


# ---- Worker.Forward --------------------------------------------------------------------
@st.composite
def valid_streams(draw: st.DrawFn) -> list[pb.ForwardRequest]:
    """1-3 valid forwards of the same new sequences, each continuing the last."""
    b = draw(st.integers(1, 3))
    seq_ids = draw(st.lists(fm.SEQ_ID, min_size=b, max_size=b, unique=True))
    dtype = draw(fm.WIRE_DTYPES)
    committed = [0] * b
    out = []
    for n in range(draw(st.integers(1, 3))):
        t = draw(st.integers(1, 6))
        widths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
        keeps = [draw(st.integers(0, w)) for w in widths]
        msg = fm.new_rows(seq_ids, t, widths, keeps, dtype, seed=n, plan_epoch=PLAN_EPOCH)
        msg.batch_id = n + 1
        msg.committed[:] = committed
        msg.positions[:] = committed
        out.append(msg)
        committed = [c + k for c, k in zip(committed, keeps, strict=True)]
    return out


@st.composite
def forward_streams(draw: st.DrawFn) -> tuple[str, list[pb.ForwardRequest]]:
    """(how it was made, 1-3 forward requests)."""
    kind = draw(st.sampled_from(["valid", "mutated", "nudged", "random", "any-message"]))
    if kind == "random":
        return kind, draw(st.lists(fm.forward_requests(), min_size=1, max_size=3))
    if kind == "any-message":
        any_message = fm.messages(pb.ForwardRequest.DESCRIPTOR)
        return kind, draw(st.lists(any_message, min_size=1, max_size=3))
    stream = draw(valid_streams())
    if kind == "mutated":  # one message of the stream with one field changed
        i = draw(st.integers(0, len(stream) - 1))
        stream[i] = draw(fm.mutated(stream[i]))
    elif kind == "nudged":  # one row's count off by a little, or at an edge
        msg = stream[draw(st.integers(0, len(stream) - 1))]
        row = draw(st.integers(0, len(msg.seq_ids) - 1))
        name = draw(st.sampled_from(["committed", "widths", "keep", "filled", "seq_ids"]))
        if name == "filled":
            filled = bytearray(msg.filled)
            filled[draw(st.integers(0, len(filled) - 1))] = draw(st.sampled_from([0, 1, 2, 255]))
            msg.filled = bytes(filled)
        elif name == "seq_ids":  # a sequence twice, or another (unknown) one
            other = (msg.seq_ids[row] + 1) % 2**64
            msg.seq_ids[row] = draw(st.sampled_from([*msg.seq_ids, other]))
        else:
            values = getattr(msg, name)
            values[row] = draw(
                st.one_of(st.integers(-2, 2).map(lambda d: values[row] + d), st.just(511))
            )
            if name == "committed":  # keep positions == committed: get past that check
                msg.positions[row] = values[row]
    return kind, stream


def _forward_replies_match(sent: list[pb.ForwardRequest], replies: list[pb.ForwardReply]):
    for request, reply in zip(sent, replies, strict=False):
        assert reply.batch_id == request.batch_id
        shape = list(request.hidden.shape)
        if request.HasField("reply_rows") and len(shape) == 3:  # only the slots it names
            shape[1] = request.reply_rows.per_row
        assert list(reply.hidden.shape) == shape
        assert reply.hidden.dtype == request.hidden.dtype
        assert reply.compute_s >= 0 and reply.queue_s >= 0


@settings(FUZZ, max_examples=examples(100))
@given(case=forward_streams(), creds=credentials())
def test_worker_forward(
    serving: Cluster, case: tuple[str, list[pb.ForwardRequest]], creds: Credentials
):
    kind, stream = case
    if kind not in ("random", "any-message"):  # of the plan the worker follows
        for msg in stream:
            msg.plan_epoch = msg.plan_epoch or PLAN_EPOCH
    responses = serving.worker_stub.Forward(
        iter(stream), metadata=creds.metadata(serving, "Forward"), timeout=CALL_S
    )
    allowed = allowed_for(creds, REFUSALS)
    try:
        replies, code = stream_call(serving, f"Forward{stream}", responses, allowed)
        _forward_replies_match(stream, replies)
        if kind == "valid" and creds.expected is None:
            assert code is None, f"a valid stream was refused: {stream}"
        if code is None:
            assert creds.expected is None, f"{creds.kind} credentials were accepted"
            assert len(replies) == len(stream)
    finally:  # a failing example must not leave rows that fail the next one
        release(serving, sorted({s for m in stream for s in m.seq_ids}))
    serving.assert_alive()


# ---- Worker.Release --------------------------------------------------------------------
@st.composite
def release_cases(draw: st.DrawFn) -> tuple[list[int], pb.ReleaseRequest]:
    """Sequences to hold first, and a Release request naming some of them."""
    held = draw(st.lists(fm.SEQ_ID, max_size=3, unique=True))
    valid = pb.ReleaseRequest(seq_ids=held)
    request = draw(
        st.one_of(
            st.just(valid),
            fm.mutated(valid),
            fm.messages(pb.ReleaseRequest.DESCRIPTOR),
            st.lists(st.one_of(st.sampled_from(held or [0]), fm.SEQ_ID), max_size=6).map(
                lambda ids: pb.ReleaseRequest(seq_ids=ids)
            ),
        )
    )
    return held, request


@FUZZ
@given(case=release_cases(), creds=credentials())
def test_worker_release(
    serving: Cluster, case: tuple[list[int], pb.ReleaseRequest], creds: Credentials
):
    held, request = case
    if held:  # give the worker their KV: one row each
        ones = [1] * len(held)
        first = fm.new_rows(held, 1, ones, ones, pb.DTYPE_FLOAT32, 0, plan_epoch=PLAN_EPOCH)
        md = serving.md("Forward")
        assert len(list(serving.worker_stub.Forward(iter([first]), metadata=md, timeout=CALL_S)))
    before = serving.worker_stub.Info(pb.InfoRequest(), metadata=serving.md("Info"), timeout=CALL_S)
    reply, code = call(
        serving,
        f"Release({request})",
        lambda: serving.worker_stub.Release(
            request, metadata=creds.metadata(serving, "Release"), timeout=CALL_S
        ),
        allowed_for(creds, REFUSALS),
    )
    assert code == creds.expected, f"Release({request}) with {creds.kind} credentials: {code}"
    if code is None:
        gone = set(held) & set(request.seq_ids)
        assert reply.released == len(gone), (reply, held, request)
        assert reply.kv_sequences == before.kv_sequences - len(gone)
    release(serving, held)
    serving.assert_alive()


# ---- Worker.Assign ---------------------------------------------------------------------
def assign_expected(request: pb.AssignRequest) -> S | None:
    """What the fixed-range (0-1) worker of a 2-layer model must answer."""
    start, end = request.layer_start, request.layer_end
    if start < 0 or end < start:
        return S.INVALID_ARGUMENT
    if end >= 2:
        return S.OUT_OF_RANGE
    if request.fetch_only:  # this worker has its own model folder: it fetches nothing
        return S.FAILED_PRECONDITION
    if (start, end) != (0, 1):
        return S.FAILED_PRECONDITION
    # quantized KV: no group size of 32 or more divides the tiny model's head dim (16),
    # and bits other than 4 and 8 are refused anyway
    if request.kv_bits:
        return S.INVALID_ARGUMENT
    if request.HasField("group"):  # a malformed group; a well-formed one is not sent
        return S.INVALID_ARGUMENT
    return None


def group_spec(request: pb.AssignRequest) -> GroupSpec:
    g = request.group
    rdma = rdma_rows(list(g.rdma_devices), g.size)
    return GroupSpec(g.rank, g.size, list(g.hosts), g.backend, g.epoch, rdma)


def well_formed_group(request: pb.AssignRequest) -> bool:
    """A group that passes every check but needs real peers to form (the tensor-group
    tests start them); a fuzzed call would wait for them."""
    if not request.HasField("group"):
        return False
    try:
        group_spec(request).check()
    except ValueError:
        return False
    return True


ASSIGN_REQUESTS = st.one_of(
    fm.messages(pb.AssignRequest.DESCRIPTOR),
    fm.mutated(pb.AssignRequest(layer_start=0, layer_end=1)),
    st.builds(pb.AssignRequest, layer_start=st.integers(-2, 3), layer_end=st.integers(-2, 3)),
)


@FUZZ
@given(request=ASSIGN_REQUESTS, creds=credentials())
def test_worker_assign(serving: Cluster, request: pb.AssignRequest, creds: Credentials):
    assume(creds.expected is not None or not well_formed_group(request))
    expected = creds.expected or assign_expected(request)
    reply, code = call(
        serving,
        f"Assign({request})",
        lambda: serving.worker_stub.Assign(
            request, metadata=creds.metadata(serving, "Assign"), timeout=CALL_S
        ),
        REFUSALS | {S.UNAUTHENTICATED},
    )
    assert code == expected, f"Assign({request}) with {creds.kind} credentials: {code}"
    if code is None:
        assert reply.has_layers and (reply.layer_start, reply.layer_end) == (0, 1)
    serving.assert_alive()


# ---- Worker.Info and credentials of every worker method --------------------------------
@FUZZ
@given(
    method=st.sampled_from(WORKER_METHODS),
    creds=credentials(st.sampled_from(sorted(BAD_AUTH))),
    request=st.one_of(
        fm.messages(pb.InfoRequest.DESCRIPTOR),
        fm.messages(pb.ReleaseRequest.DESCRIPTOR),
        fm.messages(pb.AssignRequest.DESCRIPTOR),
        fm.forward_requests(),
    ),
)
def test_worker_bad_credentials(
    serving: Cluster, method: str, creds: Credentials, request: Message
):
    """Bad credentials are refused with their precise status before anything runs."""
    fn = raw_method(serving.worker_channel, "Worker", method)
    data = request.SerializeToString()
    md = creds.metadata(serving, method)
    since = serving.mark()
    with pytest.raises(grpc.RpcError) as err:
        reply = fn(iter([data]) if method == "Forward" else data, metadata=md, timeout=CALL_S)
        list(reply) if method == "Forward" else reply
    assert err.value.code() == creds.expected, (
        f"{method} with {creds.kind} credentials {md}: {err.value.code().name} "
        f"{err.value.details()!r}{serving.logs(since)}"
    )
    serving.assert_alive()


@FUZZ
@given(data=fm.raw_requests(pb.InfoRequest.DESCRIPTOR, [pb.InfoRequest()]), creds=credentials())
def test_worker_info(serving: Cluster, data: bytes, creds: Credentials):
    """InfoRequest has no fields: any bytes that parse (unknown fields) get the info."""
    fn = raw_method(serving.worker_channel, "Worker", "Info")
    since = serving.mark()
    try:
        reply = pb.WorkerInfo.FromString(
            fn(data, metadata=creds.metadata(serving, "Info"), timeout=CALL_S)
        )
    except grpc.RpcError as e:
        if creds.expected:
            assert e.code() == creds.expected, f"{creds.kind}: {e.code()}{serving.logs(since)}"
        else:
            check_raw_refusal(serving, f"Info({data!r})", e, since, set())
    else:
        assert creds.expected is None, f"{creds.kind} credentials were accepted"
        assert reply.model_identity == serving.identity
        assert reply.protocol_version == PROTOCOL_VERSION
        assert reply.has_layers and (reply.layer_start, reply.layer_end) == (0, 1)
    serving.assert_alive()


@pytest.mark.parametrize("method", WORKER_METHODS)
def test_huge_auth_stamp_is_unauthenticated(cluster: Cluster, method: str):
    """A stamp past a float's range once escaped the check as UNKNOWN."""
    md = [
        (PROTOCOL_KEY, str(PROTOCOL_VERSION)),
        (MODEL_KEY, cluster.identity),
        (AUTH_KEY, "1" + "0" * 309 + ":n:s"),
    ]
    fn = raw_method(cluster.worker_channel, "Worker", method)
    since = cluster.mark()
    with pytest.raises(grpc.RpcError) as err:
        reply = fn(iter([b""]) if method == "Forward" else b"", metadata=md, timeout=CALL_S)
        list(reply) if method == "Forward" else reply
    code, details = err.value.code(), err.value.details()
    assert code == S.UNAUTHENTICATED, f"{code.name} {details!r}{cluster.logs(since)}"
    cluster.assert_alive()


# ---- raw bytes to every worker method --------------------------------------------------
WORKER_VALID: dict[str, list[Message]] = {
    "Forward": [fm.new_rows([1 << 40], 2, [2], [0], pb.DTYPE_FLOAT32, 0, plan_epoch=PLAN_EPOCH)],
    "Release": [pb.ReleaseRequest(seq_ids=[1 << 40, 1 << 41])],
    "Assign": [pb.AssignRequest(layer_start=0, layer_end=1)],
    "Info": [pb.InfoRequest()],
}
REQUEST_TYPES: dict[str, type[Message]] = {
    "Forward": pb.ForwardRequest,
    "Release": pb.ReleaseRequest,
    "Assign": pb.AssignRequest,
    "Info": pb.InfoRequest,
    "Generate": pb.GenerateRequest,
    "Submit": pb.GenerateRequest,
    "GetJob": pb.JobRef,
    "WaitJob": pb.WaitJobRequest,
    "CancelJob": pb.JobRef,
    "ClusterStatus": pb.ClusterStatusRequest,
    "ModelInfo": pb.ModelInfoRequest,
}


def raw_bytes(method: str, valid: list[Message]) -> st.SearchStrategy[bytes]:
    return fm.raw_requests(REQUEST_TYPES[method].DESCRIPTOR, valid)


@pytest.mark.parametrize("method", WORKER_METHODS)
@FEW
@given(data=st.data(), creds=credentials())
def test_worker_raw_bytes(serving: Cluster, method: str, data: st.DataObject, creds: Credentials):
    n = data.draw(st.integers(1, 3)) if method == "Forward" else 1  # Forward: a stream
    chunks = data.draw(st.lists(raw_bytes(method, WORKER_VALID[method]), min_size=n, max_size=n))
    fn = raw_method(serving.worker_channel, "Worker", method)
    since = serving.mark()
    try:
        request = iter(chunks) if method == "Forward" else chunks[0]
        reply = fn(request, metadata=creds.metadata(serving, method), timeout=CALL_S)
        replies = list(reply) if method == "Forward" else [reply]
    except grpc.RpcError as e:
        if creds.expected:
            assert e.code() == creds.expected, f"{creds.kind}: {e.code()}{serving.logs(since)}"
        else:
            check_raw_refusal(serving, f"{method}({chunks!r})", e, since, set())
    else:
        event("reply")
        assert creds.expected is None, f"{creds.kind} credentials were accepted"
        assert len(replies) == len(chunks)
    if method == "Forward":  # drop whatever parsed into a valid forward
        ids: set[int] = set()
        for c in chunks:
            with contextlib.suppress(DecodeError):
                ids |= set(pb.ForwardRequest.FromString(c).seq_ids)
        release(serving, sorted(ids))
    serving.assert_alive()


# ---- Coordinator.Generate and Submit ---------------------------------------------------
# (must it be accepted?, request)
GENERATE_CASES = st.one_of(
    fm.generate_requests(max_wild=0).map(lambda m: (True, m)),
    fm.generate_requests().map(lambda m: (False, m)),
    st.sampled_from(fm.VALID_GENERATE).flatmap(fm.mutated).map(lambda m: (False, m)),
    fm.messages(pb.GenerateRequest.DESCRIPTOR).map(lambda m: (False, m)),
)


def check_final(final: pb.Final, where: str) -> None:
    assert final.finish_reason in FINISH_REASONS, f"{where}: the job failed: {final}"
    assert all(0 <= t < 320 for t in final.tokens), final


@settings(FUZZ, max_examples=examples(60))
@given(case=GENERATE_CASES, events=st.integers(0, 3))
def test_coordinator_generate(serving: Cluster, case: tuple[bool, pb.GenerateRequest], events: int):
    """Read a few events and hang up, or read a short request's stream to the end."""
    valid, request = case
    short = request.HasField("max_tokens") and request.max_tokens <= 16
    limit = events if events or not short else 0  # 0: to the end
    responses = serving.stub.Generate(request, timeout=CALL_S)
    got, code = stream_call(serving, f"Generate({request})", responses, REFUSALS, limit=limit)
    assert code is None or not valid, f"a valid request was refused: {request}"
    if code is None and not limit:
        assert got and got[-1].HasField("final"), f"Generate({request}) ended without a final"
    for n, message in enumerate(got):
        kind = message.WhichOneof("event")
        assert kind in ("tokens", "final"), message
        if kind == "final":
            assert n == len(got) - 1, "events after the final"
            check_final(message.final, f"Generate({request})")
        else:
            assert all(0 <= t < 320 for t in message.tokens.ids), message
    serving.assert_alive()


@settings(FUZZ, max_examples=examples(60))
@given(case=GENERATE_CASES)
def test_coordinator_submit(serving: Cluster, case: tuple[bool, pb.GenerateRequest]):
    """An accepted job can be looked up and cancelled (so that none piles up)."""
    valid, request = case
    stub = serving.stub
    ref, code = call(
        serving, f"Submit({request})", lambda: stub.Submit(request, timeout=CALL_S), REFUSALS
    )
    assert code is None or not valid, f"a valid request was refused: {request}"
    if code is None:
        assert ref.job_id
        job = stub.CancelJob(ref, timeout=CALL_S)
        assert job.job_id == ref.job_id and job.state in ("done", "cancelled"), job
        check_final(job.result, f"Submit({request})")
        assert stub.GetJob(ref, timeout=CALL_S).state == job.state
    serving.assert_alive()


# ---- Coordinator.GetJob, WaitJob, CancelJob --------------------------------------------
@pytest.fixture(scope="module")
def known_jobs(cluster: Cluster) -> list[str]:
    """The ids of a finished job and of a cancelled one."""
    stub = cluster.stub
    done = stub.Submit(pb.GenerateRequest(text="finish me", max_tokens=2), timeout=CALL_S)
    assert stub.WaitJob(pb.WaitJobRequest(job_id=done.job_id), timeout=30).state == "done"
    long = pb.GenerateRequest(text="cancel me", mode="ar", max_tokens=400)
    cancelled = stub.Submit(long, timeout=CALL_S)
    assert stub.CancelJob(cancelled, timeout=CALL_S).state in ("cancelled", "done")
    return [done.job_id, cancelled.job_id]


def job_ids(known: list[str]) -> st.SearchStrategy[str]:
    edits = st.sampled_from(known).flatmap(
        lambda j: st.one_of(
            st.just(j.upper()),
            st.just(j[:-1]),
            st.text(max_size=3).map(lambda s, j=j: j + s),
            st.integers(0, len(j) - 1).map(lambda i, j=j: j[:i] + "x" + j[i + 1 :]),
        )
    )
    return st.one_of(st.sampled_from(known), edits, fm.TEXT, st.just(""), st.just("\x00" * 4))


def job_requests(method: str, known: list[str]) -> st.SearchStrategy[Message]:
    if method == "WaitJob":
        return st.one_of(
            st.builds(pb.WaitJobRequest, job_id=job_ids(known), timeout_s=fm.F64),
            fm.mutated(pb.WaitJobRequest(job_id=known[0], timeout_s=0.1)),
            fm.messages(pb.WaitJobRequest.DESCRIPTOR),
        )
    return st.one_of(
        st.builds(pb.JobRef, job_id=job_ids(known)),
        fm.mutated(pb.JobRef(job_id=known[1])),
        fm.messages(pb.JobRef.DESCRIPTOR),
    )


@pytest.mark.parametrize("method", ["GetJob", "WaitJob", "CancelJob"])
@FEW
@given(data=st.data())
def test_coordinator_jobs(
    serving: Cluster, known_jobs: list[str], method: str, data: st.DataObject
):
    request = data.draw(job_requests(method, known_jobs))
    fn = getattr(serving.stub, method)
    timeout = 2.0 if method == "WaitJob" else CALL_S  # WaitJob: a small deadline
    allowed = REFUSALS | ({S.DEADLINE_EXCEEDED} if method == "WaitJob" else set())
    job, code = call(serving, f"{method}({request})", lambda: fn(request, timeout=timeout), allowed)
    if request.job_id in known_jobs:
        bad_wait = method == "WaitJob" and request.timeout_s < 0
        assert (code == S.INVALID_ARGUMENT) if bad_wait else code in (None, S.DEADLINE_EXCEEDED)
    else:
        assert code == S.NOT_FOUND, f"{method}({request}): {code}"
    if code is None:
        assert job.job_id == request.job_id and job.state in ("done", "cancelled"), job
        check_final(job.result, f"{method}({request})")
    serving.assert_alive()


# ---- raw bytes to every coordinator method ---------------------------------------------
@pytest.mark.parametrize("method", COORDINATOR_METHODS)
@FEW
@given(data=st.data())
def test_coordinator_raw_bytes(
    serving: Cluster, known_jobs: list[str], method: str, data: st.DataObject
):
    valid = {
        "Generate": fm.VALID_GENERATE,
        "Submit": fm.VALID_GENERATE,
        "GetJob": [pb.JobRef(job_id=j) for j in known_jobs],
        "CancelJob": [pb.JobRef(job_id=j) for j in known_jobs],
        "WaitJob": [pb.WaitJobRequest(job_id=j, timeout_s=0.1) for j in known_jobs],
    }.get(method, [REQUEST_TYPES[method]()])
    raw = data.draw(raw_bytes(method, valid))
    fn = raw_method(serving.channel, "Coordinator", method)
    extra = {S.DEADLINE_EXCEEDED} if method == "WaitJob" else set()
    since = serving.mark()
    try:
        reply = fn(raw, timeout=2.0 if method == "WaitJob" else CALL_S)
        if method == "Generate":  # a few events, then hang up
            for n, _ in enumerate(reply):
                if n == 2:
                    reply.cancel()
                    break
    except grpc.RpcError as e:
        check_raw_refusal(serving, f"{method}({raw!r})", e, since, extra)
    else:
        event("reply")
        if method == "Submit":  # a parsed, accepted request: do not let it run on
            serving.stub.CancelJob(pb.JobRef.FromString(reply), timeout=CALL_S)
        elif method == "ClusterStatus":
            status = pb.ClusterStatusReply.FromString(reply)
            assert status.state == "serving" and status.model_identity == serving.identity
            (worker,) = status.workers
            assert worker.address == serving.worker_address and worker.health == "serving"
        elif method == "ModelInfo":
            info = pb.ModelInfoReply.FromString(reply)
            assert info.model_identity == serving.identity and info.num_layers == 2, info
            assert info.vocab_size == 320 and 0 <= info.mask_token_id < 320, info
    serving.assert_alive()


# ---- Worker.Relay and Worker.Route ----------------------------------------------------
@FEW
@given(data=st.one_of(st.binary(max_size=64), raw_bytes("Forward", WORKER_VALID["Forward"])),
       creds=credentials())  # fmt: skip
def test_worker_relay_refusals(serving: Cluster, data: bytes, creds: Credentials):
    """The fuzz cluster's one worker is fed by the coordinator: every relay is refused,
    after the credentials, whatever it carries, and the worker keeps serving."""
    relay = serving.worker_channel.stream_unary(
        "/wedlm.v1.Worker/Relay", request_serializer=lambda b: b, response_deserializer=bytes
    )
    since = serving.mark()
    with pytest.raises(grpc.RpcError) as err:
        relay(iter([data]), metadata=creds.metadata(serving, "Relay"), timeout=CALL_S)
    expected = creds.expected or S.FAILED_PRECONDITION
    assert err.value.code() == expected, f"{err.value.details()!r}{serving.logs(since)}"
    serving.assert_alive()


@FEW
@given(
    request=st.one_of(
        fm.messages(pb.RouteRequest.DESCRIPTOR).filter(
            lambda r: (r.next_stage or r.prev_stage) and ":" not in r.next_stage + r.prev_stage
        ),
        st.builds(pb.RouteRequest, next_stage=st.sampled_from(["host", ":1", "a b:2", "x:"])),
    ),
    creds=credentials(),
)
def test_worker_route_refusals(serving: Cluster, request: pb.RouteRequest, creds: Credentials):
    """A Route whose addresses are not HOST:PORT is refused (and changes nothing)."""
    before = serving.worker_stub.Info(pb.InfoRequest(), metadata=serving.md("Info")).plan_epoch
    with pytest.raises(grpc.RpcError) as err:
        serving.worker_stub.Route(
            request, metadata=creds.metadata(serving, "Route"), timeout=CALL_S
        )
    assert err.value.code() == (creds.expected or S.INVALID_ARGUMENT), err.value.details()
    after = serving.worker_stub.Info(pb.InfoRequest(), metadata=serving.md("Info")).plan_epoch
    assert after == before == PLAN_EPOCH
    serving.assert_alive()


# ---- the coordinator's ModelSource (workers fetch their layers from it) ----------------
def manifest_expected(request: pb.LayerManifestRequest) -> S | None:
    if any(not 0 <= layer < 2 for layer in [*request.layers, *request.with_sha256]):
        return S.OUT_OF_RANGE
    return None


MANIFEST_REQUESTS = st.one_of(
    fm.messages(pb.LayerManifestRequest.DESCRIPTOR),
    fm.mutated(pb.LayerManifestRequest(layers=[0, 1], with_sha256=[1], node_id="w")),
    st.builds(
        pb.LayerManifestRequest,
        layers=st.lists(st.integers(-2, 3), max_size=4),
        with_sha256=st.lists(st.integers(-1, 2), max_size=2),
        fetch_bytes=st.integers(0, 2**64 - 1),
    ),
)


@FEW
@given(request=MANIFEST_REQUESTS, creds=credentials())
def test_model_source_manifest(serving: Cluster, request, creds: Credentials):
    expected = creds.expected or manifest_expected(request)
    stub = pb_grpc.ModelSourceStub(serving.channel)
    md = creds.metadata(serving, "LayerManifest", "ModelSource")
    reply, code = call(
        serving,
        f"LayerManifest({request})",
        lambda: stub.LayerManifest(request, metadata=md, timeout=CALL_S),
        REFUSALS | {S.UNAUTHENTICATED},
    )
    assert code == expected, f"LayerManifest({request}) with {creds.kind} credentials: {code}"
    if code is None:
        assert [f.layer for f in reply.files] == list(dict.fromkeys(request.layers))
        assert all(bool(f.sha256) == (f.layer in request.with_sha256) for f in reply.files)
    serving.assert_alive()


FETCH_REQUESTS = st.one_of(
    fm.messages(pb.FetchLayerRequest.DESCRIPTOR),
    fm.mutated(pb.FetchLayerRequest(layer=1, offset=100)),
    st.builds(pb.FetchLayerRequest, layer=st.integers(-1, 2), offset=st.integers(0, 1 << 20)),
)


@FEW
@given(request=FETCH_REQUESTS, creds=credentials())
def test_model_source_fetch(serving: Cluster, request, creds: Credentials):
    files = _layer_files(serving.model)
    expected = creds.expected
    if expected is None:
        past = not 0 <= request.layer < 2 or request.offset > files[request.layer].size
        expected = S.OUT_OF_RANGE if past else None
    stub = pb_grpc.ModelSourceStub(serving.channel)
    md = creds.metadata(serving, "FetchLayer", "ModelSource")
    got, code = stream_call(
        serving,
        f"FetchLayer({request})",
        stub.FetchLayer(request, metadata=md, timeout=CALL_S),
        REFUSALS | {S.UNAUTHENTICATED},
    )
    assert code == expected, f"FetchLayer({request}) with {creds.kind} credentials: {code}"
    if code is None:
        body = b"".join(c.data for c in got)
        assert len(body) == files[request.layer].size - request.offset
        assert got[-1].sha256 == files.sha256(request.layer)
    serving.assert_alive()


@functools.cache
def _layer_files(model: Path):
    """The fuzz model's layers as the coordinator serves them."""
    from coordinator.model_source.layer_files import LayerFiles

    return LayerFiles(model, 2)
