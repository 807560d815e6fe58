"""Cluster authentication for calls between coordinator and workers.

Each call carries `x-wedlm-auth: <unix time>:<nonce>:<hex HMAC-SHA256(secret, method|time|nonce)>`,
so the secret never travels; a signature is valid for a short time and only for its method.
Protocol version and model identity travel beside it and are checked by the receiver.
Workers check the same credentials on a relay from their predecessor as on the
coordinator's calls; every refusal is logged with the caller's address."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict

import grpc

from common.proto_gen import wedlm_pb2 as pb

log = logging.getLogger(__name__)
AUTH_KEY = "x-wedlm-auth"
PROTOCOL_KEY = "x-wedlm-protocol"
MODEL_KEY = "x-wedlm-model"
MAX_SKEW_S = 120.0
PROTOCOL_VERSION = pb.PROTOCOL_VERSION_CURRENT  # proto/wedlm.proto, bumped there


def _sign(secret: str, method: str, stamp: str, nonce: str) -> str:
    msg = f"{method}|{stamp}|{nonce}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def auth_token(secret: str, method: str, now: float | None = None) -> str:
    stamp = str(int(now if now is not None else time.time()))
    nonce = secrets.token_hex(8)
    return f"{stamp}:{nonce}:{_sign(secret, method, stamp, nonce)}"


def call_metadata(secret: str | None, method: str, model_identity: str) -> list[tuple[str, str]]:
    md = [(PROTOCOL_KEY, str(PROTOCOL_VERSION)), (MODEL_KEY, model_identity)]
    if secret:
        md.append((AUTH_KEY, auth_token(secret, method)))
    return md


class TokenChecker:
    """Verifies tokens; remembers recent nonces so a captured token cannot be replayed."""

    def __init__(self, secret: str | None, memory: int = 65536) -> None:
        self.secret = secret
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._memory = memory
        self._lock = threading.Lock()  # gRPC handler threads check concurrently

    def check(self, token: str | None, method: str) -> str | None:
        """None if the call may proceed, else the reason it may not."""
        if not self.secret:
            return None
        if not token:
            return "missing cluster credentials (x-wedlm-auth)"
        try:
            stamp, nonce, sig = token.split(":")
            if len(stamp) > 12:  # a Unix time; longer ones cannot be one (or a float)
                raise ValueError(stamp)
            age = abs(time.time() - int(stamp))
        except ValueError:
            return "malformed cluster credentials"
        if age > MAX_SKEW_S:
            return "expired cluster credentials (check the clocks)"
        if not hmac.compare_digest(sig, _sign(self.secret, method, stamp, nonce)):
            return "wrong cluster secret"
        with self._lock:
            if nonce in self._seen:
                return "replayed cluster credentials"
            self._seen[nonce] = time.time()
            while len(self._seen) > self._memory:
                self._seen.popitem(last=False)
        return None


def abort_handler(
    handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, message: str
):
    def abort(_request, context):
        log.warning("refused %s from %s: %s: %s", method, context.peer(), code.name, message)
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class ClusterAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls with bad credentials, another protocol version or another model.
    The health service stays open so that load balancers and probes can use it.

    `guarded`: only methods under these prefixes are checked (the coordinator guards its
    ModelSource this way; its client service has its own API key). `any_model`: methods
    that take any model identity (a worker that fetches its model answers Info and Assign
    from a coordinator of any model: Assign is how it changes model). `model_identity` may
    change while serving."""

    def __init__(
        self,
        secret: str | None,
        model_identity: str,
        open_prefixes=("/grpc.health",),
        guarded: tuple[str, ...] | None = None,
        role: str = "worker",
    ):
        self.role = role
        self.checker = TokenChecker(secret)
        self.model_identity = model_identity
        self.open_prefixes = open_prefixes
        self.guarded = guarded
        self.any_model: frozenset[str] = frozenset()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method
        if handler is None or method.startswith(self.open_prefixes):
            return handler
        if self.guarded is not None and not method.startswith(self.guarded):
            return handler
        md = dict(details.invocation_metadata or ())
        problem = self.checker.check(md.get(AUTH_KEY), method)
        if problem:
            return abort_handler(handler, method, grpc.StatusCode.UNAUTHENTICATED, problem)
        if md.get(PROTOCOL_KEY) != str(PROTOCOL_VERSION):
            return abort_handler(
                handler,
                method,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {md.get(PROTOCOL_KEY)!r} is not this {self.role}'s "
                f"{PROTOCOL_VERSION} (install the same wedlm-cluster version on every machine)",
            )
        model, ours = md.get(MODEL_KEY), self.model_identity
        if model != ours and method not in self.any_model:
            return abort_handler(
                handler,
                method,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model identity {model!r} differs from this {self.role}'s {ours!r}",
            )
        return handler
