"""This machine's RDMA devices and where their Thunderbolt cables lead, gathered as MLX's
own `mlx.distributed_config` gathers them (mlx/_distributed_utils/config.py) for a `jaccl`
group: `ibv_devices` names the RDMA devices (`rdma_enN`, present once `rdma_ctl enable` was
run in recovery mode, macOS 26.2+), `networksetup -listallhardwareports` maps "Thunderbolt
N" ports to `enN`, and `system_profiler SPThunderboltDataType -json` gives each port's own
domain UUID and the UUID of the Mac at the other end of its cable. A worker reports the
result; the coordinator matches UUIDs across members (coordinator/cluster/rdma_mesh.py).

Anywhere these commands are missing (Linux, an older macOS, RDMA not enabled) the answer is
no ports: `jaccl` is simply not offered."""

from __future__ import annotations

import json
import logging
import platform
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 20.0  # system_profiler takes a few seconds on a busy Mac


@dataclass(frozen=True)
class RdmaPort:
    """One Thunderbolt port with an RDMA device: its device name, the port's domain UUID,
    and the domain UUID of the Mac its cable reaches ("" when nothing Mac-like is there)."""

    device: str
    domain_uuid: str
    peer_uuid: str = ""


def parse_ibv_devices(text: str) -> list[str]:
    """The RDMA device names in `ibv_devices` output (a header, a rule, then one "name
    GUID" line each); MLX's check keeps the names that start with rdma_."""
    return [w for w in text.split() if w.startswith("rdma_")]


def parse_hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports`: hardware port name -> device ("Thunderbolt
    1" -> "en2")."""
    ports: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Hardware Port:"):
            name = line.removeprefix("Hardware Port:").strip()
        elif line.startswith("Device:") and name is not None:
            ports[name] = line.removeprefix("Device:").strip()
            name = None
    return ports


def parse_thunderbolt(text: str, hardware_ports: dict[str, str]) -> list[RdmaPort]:
    """Each Thunderbolt bus of `system_profiler SPThunderboltDataType -json` that has a
    domain UUID and a network port: its `rdma_enN` device, its UUID, and the first
    connected item that has a domain UUID of its own (a Mac; a dock or a drive has none)."""
    ports = []
    for bus in json.loads(text).get("SPThunderboltDataType", []):
        uuid = bus.get("domain_uuid_key")
        tag = (bus.get("receptacle_1_tag") or {}).get("receptacle_id_key")
        iface = hardware_ports.get(f"Thunderbolt {tag}")
        if not uuid or tag is None or iface is None:
            continue
        items = bus.get("_items", [])
        peers = [item["domain_uuid_key"] for item in items if "domain_uuid_key" in item]
        ports.append(RdmaPort(f"rdma_{iface}", uuid, peers[0] if peers else ""))
    return sorted(ports, key=lambda p: p.device)


def _run(*command: str) -> str:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=True
    ).stdout


def rdma_ports() -> list[RdmaPort]:
    """This Mac's RDMA-capable Thunderbolt ports (empty anywhere RDMA is not set up)."""
    if platform.system() != "Darwin" or shutil.which("ibv_devices") is None:
        return []
    try:
        devices = set(parse_ibv_devices(_run("ibv_devices")))
        if not devices:
            return []
        hardware = parse_hardware_ports(_run("networksetup", "-listallhardwareports"))
        profile = _run("system_profiler", "SPThunderboltDataType", "-json")
        ports = parse_thunderbolt(profile, hardware)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.warning("RDMA ports not readable, jaccl not offered: %s", e)
        return []
    return [p for p in ports if p.device in devices]
