"""What `wedlm bench serve` measures: a coordinator's gRPC address or any OpenAI-compatible
base URL, named so that a result says which is which."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from common.errors import WedlmError


@dataclass
class Target:
    name: str
    kind: str  # "grpc" or "openai"
    address: str  # HOST:PORT for gRPC, the base URL (…/v1) for OpenAI
    model: str | None = None
    label: dict[str, Any] = field(default_factory=dict)


def parse_target(text: str, index: int) -> Target:
    """`[NAME=]URL`: http(s)://HOST:PORT[/v1] is an OpenAI-compatible API, grpc://HOST:PORT
    or HOST:PORT a coordinator's gRPC port."""
    head, sep, rest = text.partition("=")
    name, url = (head, rest) if sep and ":" not in head and "/" not in head else ("", text)
    name = name or f"T{index + 1}"
    if url.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(url)
        try:
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            parts = None
        if parts is None or not parts.hostname:
            raise WedlmError(f"target {text!r}: not a URL with a host and a port")
        path = parts.path.rstrip("/") or "/v1"
        return Target(name, "openai", urllib.parse.urlunsplit((*parts[:2], path, "", "")))
    address = url.removeprefix("grpc://")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WedlmError(
            f"target {text!r}: expected http(s)://HOST:PORT[/v1] (an OpenAI-compatible API) "
            "or [grpc://]HOST:PORT (a coordinator's gRPC port)"
        )
    return Target(name, "grpc", address)


def openai_model(base_url: str, timeout: float = 5.0) -> tuple[str | None, str | None]:
    """The first model id of GET /models, or why there is none."""
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=timeout) as r:
            data = json.loads(r.read())["data"]
        return (data[0]["id"], None) if data else (None, "its /models lists no model")
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return None, f"GET {base_url}/models failed: {e}"
