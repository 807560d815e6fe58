"""Registers a servicer for a service of proto/wedlm.proto, like the generated
add_*Servicer_to_server, except that a request whose bytes do not parse is answered with
INVALID_ARGUMENT and a precise message (grpcio itself answers INTERNAL)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from common.proto_gen import wedlm_pb2 as pb
from common.wire_frames import serialize

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class _Malformed:
    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"malformed {kind}: {error}"


def _lenient(cls) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as e:
            return _Malformed(cls.__name__, e)

    return parse


def _guard(method: Callable, client_streaming: bool) -> Callable:
    if client_streaming:

        def streaming(requests, context):
            def checked():
                for request in requests:
                    if isinstance(request, _Malformed):
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                    yield request

            return method(checked(), context)

        return streaming

    def unary(request, context):
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return method(request, context)

    return unary


def add_service(server: grpc.Server, servicer: object, name: str) -> None:
    service = pb.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for m in service.methods:
        request_cls = getattr(pb, m.input_type.name)
        factory = _FACTORIES[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = factory(
            _guard(getattr(servicer, m.name), m.client_streaming),
            request_deserializer=_lenient(request_cls),
            response_serializer=serialize,  # messages, or bytes already serialized
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
