"""The API key clients present (`--api-key` / WEDLM_API_KEY), as `Authorization: Bearer
KEY`: an HTTP header, or gRPC metadata on the coordinator's client service. Health checks
and reflection stay open, for load balancers and generic tools."""

from __future__ import annotations

import hmac

import grpc

from common.call_auth import abort_handler

OPEN_GRPC_PREFIXES = ("/grpc.health", "/grpc.reflection")


def bearer_matches(authorization: str | None, key: str | None) -> bool:
    if not key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class ApiKeyInterceptor(grpc.ServerInterceptor):
    def __init__(self, key: str, open_prefixes: tuple[str, ...] = ()) -> None:
        """`open_prefixes`: more methods that need no key (those with their own guard)."""
        self.key = key
        self.open_prefixes = OPEN_GRPC_PREFIXES + tuple(open_prefixes)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(self.open_prefixes):
            return handler
        md = dict(details.invocation_metadata or ())
        if bearer_matches(md.get("authorization"), self.key):
            return handler
        problem = "a wrong API key" if md.get("authorization") else "no API key"
        return abort_handler(
            handler,
            details.method,
            grpc.StatusCode.UNAUTHENTICATED,
            f"{problem}: send 'authorization: Bearer <key>' (wedlm --api-key, WEDLM_API_KEY)",
        )
