"""TLS for every gRPC connection, from certificate files the user provides.

A process with a certificate and key serves TLS; with a CA it also verifies its peers
(workers then accept only coordinators whose client certificate that CA signed). Without
any of them connections are plaintext and the cluster secret's HMAC is the only guard."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from common.errors import WedlmError


@dataclass(frozen=True)
class TlsConfig:
    cert: bytes | None = None  # PEM certificate chain of this process
    key: bytes | None = None  # PEM private key
    ca: bytes | None = None  # PEM roots that peers' certificates must chain to

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise WedlmError(f"cannot read the TLS {what} {path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise WedlmError(f"the TLS {what} {path} is not a PEM file")
    return data


def load_tls(cert=None, key=None, ca=None) -> TlsConfig:
    if (cert is None) != (key is None):
        raise WedlmError("--tls-cert and --tls-key go together")
    return TlsConfig(_read(cert, "certificate"), _read(key, "key"), _read(ca, "CA"))


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    if not tls.cert:
        return None
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=tls.ca is not None
    )


def bind(server: grpc.Server, address: str, tls: TlsConfig) -> int:
    creds = server_credentials(tls)
    if creds is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, creds)


def open_channel(address: str, tls: TlsConfig | None, options=()) -> grpc.Channel:
    if tls is None or not tls.enabled:
        return grpc.insecure_channel(address, options=list(options))
    creds = grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )
    return grpc.secure_channel(address, creds, options=list(options))
