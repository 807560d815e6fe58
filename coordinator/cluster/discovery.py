"""Finding workers: Bonjour browsing, a static `--worker HOST:PORT` list (multicast is often
blocked), and the Info probe that checks a candidate before planning. An advertisement is
spoofable, so it only nominates a worker; the authenticated Info call decides."""

from __future__ import annotations

import ipaddress
import queue
import re
import threading
from dataclasses import dataclass, replace

import grpc
from zeroconf import (
    InterfaceChoice,
    InterfacesType,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from common.call_auth import PROTOCOL_VERSION, call_metadata
from common.discovery_record import SERVICE_TYPE, WorkerAdvert
from common.errors import WedlmError
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc

INFO_METHOD = "/wedlm.v1.Worker/Info"
_HOSTNAME = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")


class DiscoveryError(WedlmError):
    """A worker address is malformed, or too few workers turned up in time."""


class WorkerProbeError(WedlmError):
    """The Info call to a candidate failed, or its answer does not match this coordinator."""

    def __init__(self, address: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"worker {address}: {code.name}: {message}")
        self.address = address
        self.code = code
        self.message = message


@dataclass
class DiscoveredWorker:
    address: str  # "host:port", IPv6 hosts in brackets
    source: str  # "bonjour" or "static"
    advert: WorkerAdvert | None = None  # what it advertised (bonjour only); unverified


class WorkerBrowser:
    """Browses `_wedlm._tcp.local.` and keeps the workers of one cluster, thread-safe.

    Zeroconf calls the listener on its browser thread, which must not block; the listener only
    queues the event, and one resolver thread of ours resolves, parses and records, in event
    order (so a removal cannot be overtaken by the resolution of an earlier addition)."""

    def __init__(
        self,
        cluster: str,
        interfaces: InterfacesType = InterfaceChoice.All,
        ip_version: IPVersion | None = None,
        loopback_only: bool = False,
        resolve_timeout_s: float = 3.0,
    ) -> None:
        if loopback_only:  # local clusters and tests: never touch the real network
            interfaces, ip_version = ["127.0.0.1"], IPVersion.V4Only
        self.cluster = cluster
        self._interfaces = interfaces
        self._ip_version = ip_version
        self._resolve_ms = int(resolve_timeout_s * 1000)
        self._lock = threading.Lock()
        self._workers: dict[str, DiscoveredWorker] = {}  # by service name
        self._rejected: dict[str, str] = {}  # service name -> reason
        self._ignored: dict[str, str] = {}  # service name -> its cluster
        self._events: queue.SimpleQueue[tuple[str, ServiceStateChange] | None]
        self._events = queue.SimpleQueue()
        self._zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._resolver: threading.Thread | None = None
        self._closing = False

    def start(self) -> WorkerBrowser:
        if self._zc is not None:
            return self
        self._zc = Zeroconf(interfaces=self._interfaces, ip_version=self._ip_version)
        self._resolver = threading.Thread(target=self._resolve_loop, name="wedlm-resolve")
        self._resolver.daemon = True
        self._resolver.start()
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change])
        return self

    def workers(self) -> list[DiscoveredWorker]:
        with self._lock:
            return sorted((replace(w) for w in self._workers.values()), key=lambda w: w.address)

    def rejected(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._rejected.items())

    def ignored(self) -> list[tuple[str, str]]:
        """(service name, cluster) of the workers that belong to other clusters."""
        with self._lock:
            return sorted(self._ignored.items())

    def close(self) -> None:
        self._closing = True
        if self._browser is not None:
            self._browser.cancel()
        self._events.put(None)
        if self._resolver is not None:
            self._resolver.join(timeout=self._resolve_ms / 1000 + 1)
        if self._zc is not None:
            self._zc.close()
        self._browser = self._resolver = self._zc = None

    def __enter__(self) -> WorkerBrowser:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        self._events.put((name, state_change))

    def _resolve_loop(self) -> None:
        while (event := self._events.get()) is not None:
            name, change = event
            try:
                if change is ServiceStateChange.Removed:
                    self._record(name)
                else:
                    self._resolve(name)
            except Exception as exc:  # keep browsing whatever one record does
                if self._closing:
                    return
                self._record(name, self._rejected, f"could not be resolved: {exc}")

    def _resolve(self, name: str) -> None:
        info = ServiceInfo(SERVICE_TYPE, name)
        if not info.request(self._zc, self._resolve_ms):
            self._record(name, self._rejected, f"did not resolve in {self._resolve_ms} ms")
            return
        try:
            advert = WorkerAdvert.from_txt(info.properties)
        except ValueError as exc:
            self._record(name, self._rejected, f"malformed advertisement: {exc}")
            return
        if advert.cluster != self.cluster:
            self._record(name, self._ignored, advert.cluster)
        elif advert.protocol != PROTOCOL_VERSION:
            why = f"speaks protocol {advert.protocol}, not {PROTOCOL_VERSION}"
            self._record(name, self._rejected, why)
        elif (address := _service_address(info)) is None:
            self._record(name, self._rejected, "advertises no address")
        else:
            self._record(name, self._workers, DiscoveredWorker(address, "bonjour", advert))

    def _record(self, name: str, table: dict | None = None, value: object = None) -> None:
        """Put `name` in at most one of the three tables (in none: it was removed)."""
        with self._lock:
            for each in (self._workers, self._rejected, self._ignored):
                each.pop(name, None)
            if table is not None:
                table[name] = value


def _service_address(info: ServiceInfo) -> str | None:
    if info.port is None:
        return None
    if v4 := info.parsed_addresses(IPVersion.V4Only):
        return f"{v4[0]}:{info.port}"
    if v6 := info.parsed_scoped_addresses(IPVersion.V6Only):
        return f"[{v6[0]}]:{info.port}"
    return None


def parse_static(addresses: list[str]) -> list[DiscoveredWorker]:
    """Validate `HOST:PORT` entries (IPv6 as `[addr]:port`); duplicates are dropped."""
    found: dict[str, DiscoveredWorker] = {}
    for text in addresses:
        address = _check_address(text)
        found.setdefault(address, DiscoveredWorker(address, "static"))
    return list(found.values())


def _check_address(text: str) -> str:
    def bad(why: str) -> DiscoveryError:
        return DiscoveryError(
            f"invalid worker address {text!r}: {why}; expected HOST:PORT, "
            "e.g. 192.168.1.20:50051, mac-studio.local:50051 or [fe80::1]:50051"
        )

    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise bad("no host" if sep else "no port")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise bad(f"port {port!r} is not a number from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise bad(f"{host} is not an IPv6 address") from None
    elif ":" in host:
        raise bad("write an IPv6 host in brackets")
    elif not _HOSTNAME.match(host):
        raise bad(f"{host!r} is not a host name or address")
    elif all(part.isdigit() for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise bad(f"{host} is not an IPv4 address") from None
    return f"{host}:{int(port)}"


def probe_worker(
    address: str, secret: str | None, model_identity: str, timeout_s: float
) -> pb.WorkerInfo:
    """One authenticated Info call with a deadline; raises WorkerProbeError on failure, or when
    the worker's protocol or model differs from ours."""
    with grpc.insecure_channel(address) as channel:
        try:
            info = pb_grpc.WorkerStub(channel).Info(
                pb.InfoRequest(),
                timeout=timeout_s,
                metadata=call_metadata(secret, INFO_METHOD, model_identity),
            )
        except grpc.RpcError as exc:
            raise WorkerProbeError(address, exc.code(), exc.details() or "") from None
    wrong = grpc.StatusCode.FAILED_PRECONDITION
    if info.protocol_version != PROTOCOL_VERSION:
        raise WorkerProbeError(
            address, wrong, f"speaks protocol {info.protocol_version}, not {PROTOCOL_VERSION}"
        )
    if info.model_identity != model_identity:
        raise WorkerProbeError(
            address, wrong, f"serves model {info.model_identity!r}, not {model_identity!r}"
        )
    return info


def merge_candidates(
    static: list[DiscoveredWorker], seen: list[DiscoveredWorker]
) -> list[DiscoveredWorker]:
    """Static workers (in their order) then discovered ones, deduplicated by address; a
    listed worker that also advertises keeps its advert."""
    found = {w.address: replace(w) for w in static}
    for w in seen:
        if w.address in found:  # listed and advertised: keep it static, note the advert
            found[w.address].advert = found[w.address].advert or w.advert
        else:
            found[w.address] = replace(w)
    return list(found.values())


def shortfall(
    found: list[DiscoveredWorker], expect: int, timeout_s: float, browser: WorkerBrowser | None
) -> str:
    """Why fewer than `expect` workers are known, naming the rejected ones."""
    listed = ", ".join(f"{w.address} ({w.source})" for w in found) or "none"
    if browser is None:
        return f"expected {expect} workers but only {len(found)} were listed: {listed}"
    msg = f"found {len(found)} of {expect} workers within {timeout_s:g} s: {listed}"
    if rejected := browser.rejected():
        msg += "; rejected: " + ", ".join(f"{name} ({why})" for name, why in rejected)
    if ignored := browser.ignored():
        msg += f"; ignored {len(ignored)} from other clusters"
    return msg + " (if multicast is blocked, list workers with --worker HOST:PORT)"
