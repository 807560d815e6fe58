"""What to tell someone who pointed a gRPC command at an HTTP port (the coordinator's HTTP
API, or any web server): gRPC's own words ("Failed parsing HTTP/2 (Expected SETTINGS
frame...)") say nothing a newcomer can act on. The coordinator's HTTP API says where its
gRPC port is (the console's state names the coordinator's gRPC address), so the hint can
name it. Plain urllib: the client install has no HTTP library of its own."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

DEFAULT_GRPC_PORT = 50051
PROBE_TIMEOUT_S = 3.0
# what gRPC's transport says when the other end answered in HTTP/1.x
HTTP1_SIGNS = ("Failed parsing HTTP/2", "Expected SETTINGS frame", "http1.x server")
_hints: dict[tuple[str, str | None], str | None] = {}  # a closed loop asks once per address


def answered_http1(details: str) -> bool:
    return any(sign in details for sign in HTTP1_SIGNS)


def http_port_hint(address: str, api_key: str | None) -> str | None:
    """The message for an address whose server answered HTTP/1.x to gRPC, or None when it
    does not answer HTTP after all (then gRPC's own error stands)."""
    key = (address, api_key)
    if key not in _hints:
        _hints[key] = _probe(address, api_key)
    return _hints[key]


def _probe(address: str, api_key: str | None) -> str | None:
    base = f"http://{address}"
    if _get(f"{base}/health", None) is None:
        return None
    grpc_address = _grpc_address(base, address, api_key)
    if grpc_address is not None:
        return (f"{address} is the coordinator's HTTP port, not its gRPC port: "
                f"the gRPC port is {grpc_address} (try --cluster {grpc_address})")  # fmt: skip
    return (f"{address} answers HTTP, not gRPC: this looks like an HTTP port; is this the "
            f"coordinator's gRPC port? (default {DEFAULT_GRPC_PORT}; the coordinator prints "
            f"'listening on HOST:PORT' when it starts)")  # fmt: skip


def _grpc_address(base: str, address: str, api_key: str | None) -> str | None:
    """HOST:PORT of the coordinator's gRPC port: the port its console state names, on the
    host the user gave (the coordinator may listen on 0.0.0.0)."""
    got = _get(f"{base}/console/state", api_key)
    if got is None or got[0] != 200:  # not our coordinator, or its API key is not ours
        return None
    try:
        members = json.loads(got[1])["members"]
        listens = next(m["address"] for m in members if m.get("role") == "coordinator")
    except (ValueError, KeyError, TypeError, StopIteration):
        return None
    port = str(listens).rpartition(":")[2]
    host = address.rpartition(":")[0]
    return f"{host}:{port}" if port.isdigit() and host else None


def _get(url: str, api_key: str | None) -> tuple[int, str] | None:
    """(status, body) of a GET, or None when nothing answered HTTP there."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=PROBE_TIMEOUT_S) as r:  # fmt: skip
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:  # an error status is an HTTP answer too
        return e.code, ""
    except (OSError, ValueError):
        return None
