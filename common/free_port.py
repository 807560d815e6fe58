"""A TCP port free now on a host (for a process that binds it a moment later: a tensor
group's ring listener)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
