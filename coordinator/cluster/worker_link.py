"""The coordinator's connection to one worker: a long-lived Forward stream (requests go out
as they are sent; replies, when the worker is the last stage, come back in order) plus
unary calls, each with a deadline."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.call_auth import call_metadata
from common.grpc_services import CHANNEL_OPTIONS
from common.kv_format import FULL, KVFormat
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.tensor_group.spec import GroupSpec
from common.tls import TlsConfig, open_channel
from common.wire_frames import TensorFrame, framed_parser, serialize, with_tensor

log = logging.getLogger(__name__)
_CLOSE = object()
ASSIGN_DEADLINE_S = 6 * 3600.0  # loading, or fetching tens of GB over Wi-Fi


class WorkerCallError(RuntimeError):
    """A call to a worker failed or missed its deadline; `code` is the gRPC status."""

    def __init__(self, address: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"worker {address}: {code.name}: {message}")
        self.address = address
        self.code = code


@dataclass
class HopStats:
    compute_s: deque = field(default_factory=lambda: deque(maxlen=256))
    roundtrip_s: deque = field(default_factory=lambda: deque(maxlen=256))
    fresh: deque = field(default_factory=lambda: deque(maxlen=4096))  # not yet exported

    def add(self, compute: float, roundtrip: float) -> None:
        self.compute_s.append(compute)
        self.roundtrip_s.append(roundtrip)
        self.fresh.append(compute)

    def drain_new(self) -> list[float]:
        out = []
        while self.fresh:
            out.append(self.fresh.popleft())
        return out


class WorkerLink:
    def __init__(
        self,
        address: str,
        secret: str | None,
        model_identity: str,
        deadline_s: float = 30.0,
        tls: TlsConfig | None = None,
    ) -> None:
        self.address = address
        self.secret = secret
        self.model_identity = model_identity
        self.deadline_s = deadline_s
        self.channel = open_channel(address, tls, CHANNEL_OPTIONS)
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.stats = HopStats()
        self.latest_info: pb.WorkerInfo | None = None  # the last heartbeat's answer (memory now)
        self._outbox: queue.Queue | None = None
        self._stream = None
        self._replies: queue.Queue = queue.Queue()
        self._sent_at: list[float] = []
        self._lock = threading.Lock()
        # When set, replies (or a WorkerCallError) go to this callback on the reader
        # thread instead of the receive() queue: pipelines relay them to the next stage.
        self.on_reply: Callable[[pb.ForwardReply | WorkerCallError], None] | None = None

    def _md(self, method: str):
        return call_metadata(self.secret, f"/wedlm.v1.Worker/{method}", self.model_identity)

    # ---- unary calls ------------------------------------------------------------------
    def _unary(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self.stub, method)(
                request, metadata=self._md(method), timeout=timeout or self.deadline_s
            )
        except grpc.RpcError as e:
            raise WorkerCallError(self.address, e.code(), e.details() or "") from None

    def info(self, timeout: float | None = None) -> pb.WorkerInfo:
        return self._unary("Info", pb.InfoRequest(), timeout)

    def assign(
        self,
        start: int,
        end: int,
        model_source: str = "",
        fetch_only: bool = False,
        timeout: float = ASSIGN_DEADLINE_S,
        kv: KVFormat = FULL,
        group: GroupSpec | None = None,
    ) -> pb.WorkerInfo:
        """Load layers start-end, alone or as a member of `group` (a worker that fetches
        its layers first fetches the ones it lacks from `model_source`: hence the long
        deadline; a worker that dies meanwhile ends the call at once through the
        channel's keepalive)."""
        request = pb.AssignRequest(
            layer_start=start, layer_end=end, model_source=model_source, fetch_only=fetch_only,
            kv_bits=kv.bits or 0, kv_group_size=kv.group_size,
        )  # fmt: skip
        if group is not None:
            request.group.CopyFrom(
                pb.TensorGroup(
                    rank=group.rank,
                    size=group.size,
                    hosts=group.hosts,
                    backend=group.backend,
                    epoch=group.epoch,
                    rdma_devices=group.flat_rdma(),
                )
            )
        return self._unary("Assign", request, timeout)

    def echo(self, payload: bytes, timeout: float) -> None:
        """One link-probe message to the worker's Echo (`--tp auto`)."""
        self._unary("Echo", pb.EchoRequest(payload=payload), timeout)

    def probe_link(self, peer: str, timeout_s: float) -> pb.ProbeLinkReply:
        """The worker's read bandwidth and, with `peer`, its link's figures to that worker."""
        request = pb.ProbeLinkRequest(peer=peer, timeout_s=timeout_s)
        return self._unary("ProbeLink", request, timeout_s + 5.0)  # + the first read probe

    def route(self, epoch: int, next_stage: str, prev_stage: str) -> pb.WorkerInfo:
        request = pb.RouteRequest(plan_epoch=epoch, next_stage=next_stage, prev_stage=prev_stage)
        return self._unary("Route", request)

    def release(self, seq_ids: list[int]) -> pb.ReleaseReply:
        return self._unary("Release", pb.ReleaseRequest(seq_ids=seq_ids))

    def release_soon(self, seq_ids: list[int]) -> None:
        """Release without waiting for the reply; a failure is only logged."""
        call = self.stub.Release.future(
            pb.ReleaseRequest(seq_ids=seq_ids), metadata=self._md("Release"),
            timeout=self.deadline_s,
        )  # fmt: skip
        call.add_done_callback(self._log_release_failure)

    def _log_release_failure(self, call) -> None:
        if call.code() is not grpc.StatusCode.OK:
            log.warning("release on %s failed: %s %s", self.address, call.code().name,
                        call.details())  # fmt: skip

    # ---- the forward stream ------------------------------------------------------------
    def _open_stream(self) -> None:
        outbox: queue.Queue = queue.Queue()

        def requests():
            while (item := outbox.get()) is not _CLOSE:
                # (header, hidden) pairs are framed here, on gRPC's thread, not the engine's
                yield with_tensor(item[0], "hidden", item[1]) if isinstance(item, tuple) else item

        # Requests arrive serialized (hidden states framed by hand): passed through as is.
        forward = self.channel.stream_stream(
            "/wedlm.v1.Worker/Forward",
            request_serializer=serialize,
            response_deserializer=framed_parser(pb.ForwardReply, "hidden"),  # no payload copy
            _registered_method=True,  # as the generated stubs register their methods
        )
        replies = forward(requests(), metadata=self._md("Forward"))
        self._stream = replies
        threading.Thread(target=self._read, args=(replies,), daemon=True).start()
        self._outbox = outbox

    def _read(self, replies) -> None:
        try:
            for reply in replies:
                self._deliver(reply)
            error = WorkerCallError(self.address, grpc.StatusCode.CANCELLED, "stream closed")
        except grpc.RpcError as e:
            error = WorkerCallError(self.address, e.code(), e.details() or "")
        if replies is self._stream:  # a stream dropped on purpose reports nothing
            self._reset()
            self._deliver(error)

    def _deliver(self, item: pb.ForwardReply | WorkerCallError) -> None:
        if self.on_reply is not None:  # a chain: it keeps the timings of every stage
            self.on_reply(item)
            return
        if not isinstance(item, WorkerCallError):
            sent = self._sent_at.pop(0) if self._sent_at else time.perf_counter()
            self.stats.add(item.compute_s, time.perf_counter() - sent)
        self._replies.put(item)

    def open(self) -> None:
        """Open the Forward stream now (the last stage answers on it without being sent
        anything; any stage reports a broken relay on it)."""
        with self._lock:
            if self._outbox is None:
                self._open_stream()

    def send(self, request: pb.ForwardRequest | bytes | tuple[pb.ForwardRequest, TensorFrame]):
        """A request: a message, its serialized bytes, or (header, hidden states)."""
        with self._lock:
            if self._outbox is None:
                self._open_stream()
            if self.on_reply is None:
                self._sent_at.append(time.perf_counter())
            self._outbox.put(request)

    def receive(self, timeout: float | None = None) -> pb.ForwardReply:
        """The reply to the oldest request in flight, or WorkerCallError."""
        try:
            item = self._replies.get(timeout=timeout or self.deadline_s)
        except queue.Empty:
            self._reset()
            raise WorkerCallError(
                self.address, grpc.StatusCode.DEADLINE_EXCEEDED, "no reply to a forward"
            ) from None
        if isinstance(item, WorkerCallError):
            raise item
        return item

    def _reset(self) -> None:
        """Drop the stream; the next send opens a fresh one."""
        with self._lock:
            if self._outbox is not None:
                self._outbox.put(_CLOSE)
            self._outbox = None
            self._stream = None
            self._sent_at.clear()
            self._replies = queue.Queue()

    def close(self) -> None:
        self._reset()
        self.channel.close()
