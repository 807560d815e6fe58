"""Every gRPC channel or server option the project passes is one gRPC core knows.

gRPC core ignores an option name it does not know, silently. A misspelt ping policy
("grpc.http2.min_recv_ping_interval_without_data_ms") left the workers at the default of
one ping per 5 minutes without data, and coordinators' idle channels ended in GOAWAY
"too_many_pings". The names gRPC core reads are strings inside its compiled library."""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from common.grpc_services import CHANNEL_OPTIONS, SERVER_PING_POLICY
from shard_worker.server import GRPC_OPTIONS
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
OPTION = re.compile(r"""["'](grpc\.[a-z0-9_.]+)["']""")
PARTS = ("common", "coordinator", "shard_worker", "wedlm_client")


def _core_names() -> set[str]:
    names: set[str] = set()
    for lib in Path(grpc.__file__).parent.rglob("*.so"):
        names.update(m.decode() for m in re.findall(rb"grpc\.[a-z0-9_.]+", lib.read_bytes()))
    return names


def _project_names() -> dict[str, str]:
    found = {}
    for part in PARTS:
        for path in (ROOT / part).rglob("*.py"):
            if "proto_gen" in path.parts:
                continue
            for name in OPTION.findall(path.read_text()):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_option_names_are_known_to_grpc_core():
    core = _core_names()
    assert "grpc.keepalive_time_ms" in core  # the scan reads the library at all
    used = _project_names()
    for name, _ in CHANNEL_OPTIONS + GRPC_OPTIONS + SERVER_PING_POLICY:
        used.setdefault(name, "an options list")
    unknown = {name: where for name, where in used.items() if name not in core}
    assert not unknown, f"gRPC core does not know these option names: {unknown}"


def test_servers_accept_the_channels_pings():
    """Channels ping every keepalive_time_ms; servers allow pings at least that often."""
    ping_every = dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"]
    policy = dict(SERVER_PING_POLICY)
    assert policy["grpc.keepalive_permit_without_calls"] == 1
    assert policy["grpc.http2.min_ping_interval_without_data_ms"] <= ping_every
    assert set(SERVER_PING_POLICY) <= set(GRPC_OPTIONS)
