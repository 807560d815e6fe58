"""Registers a servicer for a service of proto/wedlm.proto, like the generated
add_*Servicer_to_server, except that a request whose bytes do not parse is answered with
INVALID_ARGUMENT and a precise message (grpcio itself answers INTERNAL)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from common.proto_gen import wedlm_pb2 as pb
from common.wire_frames import serialize

MESSAGE_LIMIT = 256 * 1024 * 1024
# Channels between cluster members (coordinator to worker, worker to worker): large
# messages, and keepalive pings so that a peer that vanished is noticed on an idle link.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# Servers that such channels dial accept those pings, also between calls. gRPC core ignores
# an option name it does not know: a misspelt one left its default (one ping per 5 minutes
# without data) and idle links ended in GOAWAY "too_many_pings"
# (tests/repo/test_grpc_options.py).
SERVER_PING_POLICY = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class MalformedRequest(ValueError):
    """Raised while iterating a request stream at a message whose bytes do not parse
    (a handler reading its stream on another thread maps it to INVALID_ARGUMENT itself)."""


class _Malformed:
    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"malformed {kind}: {error}"


def _lenient(parse: Callable[[bytes], object], kind: str) -> Callable[[bytes], object]:
    def lenient(data: bytes):
        try:
            return parse(data)
        except (DecodeError, ValueError) as e:
            return _Malformed(kind, e)

    return lenient


def _guard(method: Callable, client_streaming: bool, server_streaming: bool) -> Callable:
    if client_streaming:

        def checked(requests):
            for request in requests:
                if isinstance(request, _Malformed):
                    raise MalformedRequest(request.message)
                yield request

        if server_streaming:

            def both(requests, context):
                try:
                    yield from method(checked(requests), context)
                except MalformedRequest as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

            return both

        def streaming(requests, context):
            try:
                return method(checked(requests), context)
            except MalformedRequest as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        return streaming

    def unary(request, context):
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return method(request, context)

    return unary


def add_service(
    server: grpc.Server,
    servicer: object,
    name: str,
    parsers: dict[str, Callable[[bytes], object]] | None = None,
) -> None:
    """`parsers`: a deserializer per method name instead of the message's FromString
    (e.g. one that leaves a large tensor field in the received bytes)."""
    service = pb.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for m in service.methods:
        request_cls = getattr(pb, m.input_type.name)
        parse = (parsers or {}).get(m.name, request_cls.FromString)
        factory = _FACTORIES[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = factory(
            _guard(getattr(servicer, m.name), m.client_streaming, m.server_streaming),
            request_deserializer=_lenient(parse, request_cls.__name__),
            response_serializer=serialize,  # messages, or bytes already serialized
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def enable_reflection(server: grpc.Server, services: tuple[str, ...] = ("Coordinator",)) -> None:
    """gRPC server reflection (grpcio-reflection), so that grpcurl and other generic tools
    can list and call these services without the .proto file."""
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection

    names = [pb.DESCRIPTOR.services_by_name[s].full_name for s in services]
    names += [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
