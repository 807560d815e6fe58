"""The coordinator's gRPC server: its message limits, keep-alive policy and who may call
what (workers' layer fetches carry the cluster's credentials, clients' calls the API key)."""

from __future__ import annotations

from concurrent import futures

import grpc

from common.call_auth import ClusterAuthInterceptor
from common.grpc_services import MESSAGE_LIMIT, SERVER_PING_POLICY
from coordinator.service.api_key import ApiKeyInterceptor

MODEL_SOURCE = "/wedlm.v1.ModelSource/"


def coordinator_grpc_server(
    secret: str | None, identity: str, api_key: str | None, max_request_bytes: int
) -> grpc.Server:
    # Workers' fetches carry the cluster's credentials; clients' calls the API key.
    interceptors = [
        ClusterAuthInterceptor(secret, identity, guarded=(MODEL_SOURCE,), role="coordinator")
    ]
    if api_key:
        interceptors.append(ApiKeyInterceptor(api_key, open_prefixes=(MODEL_SOURCE,)))
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=64),
        options=[
            ("grpc.max_send_message_length", MESSAGE_LIMIT),  # layer files, to workers
            # What this server receives is small: clients' requests, and workers' fetch
            # requests and health checks (hidden states travel on the channels it
            # dials, with their own 256 MB limit). A larger message is refused before
            # it is read whole, with RESOURCE_EXHAUSTED naming the limit.
            ("grpc.max_receive_message_length", max_request_bytes),
            *SERVER_PING_POLICY,  # workers' fetch channels ping every 10 s
        ],
        interceptors=interceptors,
    )
