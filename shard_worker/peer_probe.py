"""A worker's side of `--tp auto`'s link survey: it measures its link to a peer worker by
sending the probe's messages to the peer's Echo, with the cluster's credentials (the
coordinator asks through ProbeLink; the link between two workers is not the coordinator's
to time)."""

from __future__ import annotations

import grpc

from common import link_probe
from common.call_auth import call_metadata
from common.grpc_services import CHANNEL_OPTIONS
from common.proto_gen import wedlm_pb2 as pb
from common.tls import TlsConfig, open_channel

ECHO_METHOD = "/wedlm.v1.Worker/Echo"


class PeerProbe:
    def __init__(self, secret: str | None, tls: TlsConfig | None) -> None:
        self.secret = secret
        self.tls = tls

    def measure(self, peer: str, model_identity: str, timeout_s: float) -> pb.LinkFigures:
        """The figures of this worker's link to `peer` (an error is their `error`; the
        coordinator names this worker's end, as it knows its address)."""
        with open_channel(peer, self.tls, CHANNEL_OPTIONS) as channel:
            call = channel.unary_unary(
                ECHO_METHOD,
                request_serializer=pb.EchoRequest.SerializeToString,
                response_deserializer=pb.EchoReply.FromString,
                _registered_method=True,
            )

            def echo(payload: bytes, timeout: float) -> None:
                md = call_metadata(self.secret, ECHO_METHOD, model_identity)
                try:
                    call(pb.EchoRequest(payload=payload), metadata=md, timeout=timeout)
                except grpc.RpcError as e:
                    raise ConnectionError(f"{e.code().name}: {e.details()}") from None

            return link_probe.measure(echo, "", peer, timeout_s)
