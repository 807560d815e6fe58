"""Where this stage's outputs go. Under a plan (Route), a stage either relays each output
to its successor over one long-lived Relay stream, or, as the last stage, answers on the
coordinator's Forward stream. A relay that breaks is reported on that same coordinator
stream: ending it with the reason is how the coordinator learns that the chain is broken."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import grpc

from common.call_auth import call_metadata
from common.grpc_services import CHANNEL_OPTIONS
from common.proto_gen import wedlm_pb2 as pb
from common.tls import TlsConfig, open_channel
from common.wire_frames import TensorFrame, serialize, with_tensor

log = logging.getLogger(__name__)
RELAY_METHOD = "/wedlm.v1.Worker/Relay"
_END = object()


@dataclass(frozen=True)
class Failure:
    code: grpc.StatusCode
    message: str


class ReplyChannel:
    """The coordinator's current Forward stream into this worker: the handler's generator
    yields what is put here, and ends the call with a Failure's status."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, reply: pb.ForwardReply, hidden: TensorFrame) -> None:
        self._items.put((reply, hidden))

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        self._items.put(Failure(code, message))

    def close(self) -> None:
        self._items.put(_END)

    def items(self):
        """Serialized replies until closed (framed here, on the stream's own thread, not on
        the MLX thread); a Failure is the last item when there is one."""
        while (item := self._items.get()) is not _END:
            if isinstance(item, Failure):
                yield item
                return
            yield with_tensor(item[0], "hidden", item[1])


class RelayLink:
    """This stage's stream to its successor. Sends never block the MLX thread: payloads
    are queued and gRPC's own thread writes them."""

    def __init__(
        self,
        address: str,
        secret: str | None,
        model_identity: str,
        tls: TlsConfig | None,
        on_broken,
    ) -> None:
        self.address = address
        self._on_broken = on_broken
        self._closing = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._channel = open_channel(address, tls, CHANNEL_OPTIONS)
        relay = self._channel.stream_unary(
            RELAY_METHOD,
            request_serializer=serialize,  # requests arrive framed by hand
            response_deserializer=pb.RelayReply.FromString,
            _registered_method=True,
        )
        metadata = call_metadata(secret, RELAY_METHOD, model_identity)
        self._call = relay.future(self._requests(), metadata=metadata)
        self._call.add_done_callback(self._ended)

    def _requests(self):
        while (item := self._outbox.get()) is not _END:
            yield with_tensor(item[0], "hidden", item[1])  # on gRPC's thread, not MLX's

    def send(self, request: pb.ForwardRequest, hidden: TensorFrame) -> None:
        self._outbox.put((request, hidden))

    def _ended(self, call) -> None:
        if self._closing:
            return
        try:
            code, details = call.code(), call.details()
        except grpc.FutureCancelledError:
            code, details = grpc.StatusCode.CANCELLED, "cancelled"
        self._on_broken(self.address, code, details or "the relay stream ended")

    def close(self) -> None:
        self._closing = True
        self._outbox.put(_END)
        self._call.cancel()
        self._channel.close()


@dataclass(frozen=True)
class Plan:
    epoch: int = 0
    next_stage: str = ""  # "" for the last stage
    prev_stage: str = ""  # "" when the coordinator feeds this stage


class StageRoute:
    """The plan this worker follows, its relay link and the coordinator's reply channel."""

    def __init__(self, secret: str | None, model_identity: str, tls: TlsConfig | None) -> None:
        self._secret, self._identity, self._tls = secret, model_identity, tls
        self._lock = threading.Lock()
        self.plan = Plan()
        self._relay: RelayLink | None = None
        self._channels: list[ReplyChannel] = []  # open coordinator streams, newest last

    def use_model(self, model_identity: str) -> None:
        """Relays opened from now on carry this identity (a fetching worker changed model)."""
        self._identity = model_identity

    def follow(self, plan: Plan) -> None:
        """Take a new plan: the old relay closes and the new successor is dialled now, so
        the first micro-batch finds the stream open."""
        with self._lock:
            old, self._relay = self._relay, None
            self.plan = plan
            if plan.next_stage:
                self._relay = RelayLink(
                    plan.next_stage, self._secret, self._identity, self._tls, self._broken
                )
        if old is not None:
            old.close()

    def attach(self) -> ReplyChannel:
        """A new Forward stream from the coordinator: relayed work answers and failures
        are reported on the newest one (a stream's own requests answer on it)."""
        channel = ReplyChannel()
        with self._lock:
            self._channels.append(channel)
        return channel

    def detach(self, channel: ReplyChannel) -> None:
        with self._lock:
            if channel in self._channels:
                self._channels.remove(channel)
        channel.close()

    @property
    def _channel(self) -> ReplyChannel | None:
        return self._channels[-1] if self._channels else None

    def deliver(
        self,
        plan: Plan,
        request: pb.ForwardRequest,
        reply: pb.ForwardReply,
        hidden: TensorFrame,
        origin: ReplyChannel | None = None,
    ) -> None:
        """Hand an output on under `plan` (the one its input arrived under): relayed to the
        successor as `request` (the input's header) with these hidden states, or as `reply`
        to the coordinator, on the stream the input came in on (`origin`) or, for relayed
        input, the newest coordinator stream. Outputs of an older plan are dropped: the
        coordinator has discarded those micro-batches."""
        with self._lock:
            if plan != self.plan:
                return
            relay, channel = self._relay, origin or self._channel
        if plan.next_stage:
            relay.send(request, hidden)
        elif channel is not None:
            channel.put(reply, hidden)
        else:
            log.warning("a forward finished with no coordinator stream to answer on")

    def fail(self, code: grpc.StatusCode, message: str, origin: ReplyChannel | None = None) -> None:
        """Tell the coordinator, by ending its stream (`origin`, else the newest) with
        this status."""
        with self._lock:
            channel = origin or self._channel
        if channel is not None:
            channel.fail(code, message)
        else:
            log.warning("%s: %s (no coordinator stream to report it on)", code.name, message)

    def _broken(self, address: str, code: grpc.StatusCode, details: str) -> None:
        log.warning("relay to %s broke: %s %s", address, code.name, details)
        with self._lock:
            current = self._relay is not None and self._relay.address == address
        if current:
            self.fail(grpc.StatusCode.UNAVAILABLE, f"relay to {address}: {code.name}: {details}")

    def close(self) -> None:
        self.follow(Plan())
        with self._lock:
            channels, self._channels = self._channels, []
        for channel in channels:
            channel.close()
