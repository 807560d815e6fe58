"""Advertises a worker as `_wedlm._tcp.local.` over mDNS/DNS-SD. Registration probes the
network for a couple of seconds, so it runs in the background: the worker serves at once,
and a worker whose multicast is blocked still serves (coordinators list it statically)."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

import psutil
from zeroconf import (
    InterfaceChoice,
    IPVersion,
    NonUniqueNameException,
    ServiceInfo,
    Zeroconf,
)

from common.discovery_record import SERVICE_TYPE, WorkerAdvert

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advertised_addresses(bind_host: str, advertise_host: str | None) -> list[str]:
    """The addresses peers should dial: the explicit one, the bound one, or (bound to
    every interface) each non-loopback IPv4 address of this host."""
    if advertise_host:
        return [advertise_host]
    if is_loopback(bind_host):
        return ["127.0.0.1"]
    if bind_host not in ("0.0.0.0", "", "::", "[::]"):
        return [socket.gethostbyname(bind_host)]
    found = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    ]
    return sorted(set(found)) or ["127.0.0.1"]


class BonjourAdvert:
    def __init__(self, bind_host: str, port: int, advertise_host: str | None = None) -> None:
        self.port = port
        self.addresses = advertised_addresses(bind_host, advertise_host)
        self.loopback_only = all(is_loopback(a) for a in self.addresses)
        self._zc: Zeroconf | None = None
        self._info: ServiceInfo | None = None
        self._lock = threading.Lock()  # one zeroconf call at a time, close last
        self._closed = False
        self._latest: WorkerAdvert | None = None  # what the next zeroconf call publishes

    def start(self, advert: WorkerAdvert) -> None:
        self._latest = advert
        threading.Thread(target=self._register, daemon=True).start()

    def update(self, advert: WorkerAdvert) -> None:
        """Refresh the TXT record (memory changes after an Assign), in the background."""
        self._latest = advert
        threading.Thread(target=self._update, daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._zc is None:
                return
            try:
                if self._info is not None:
                    self._zc.unregister_service(self._info)
            except Exception as e:  # shutting down anyway; say why the record may linger
                log.warning("could not withdraw the Bonjour advertisement: %s", e)
            finally:
                self._zc.close()
                self._zc = None

    def _service(self, advert: WorkerAdvert) -> ServiceInfo:
        return ServiceInfo(
            SERVICE_TYPE,
            advert.instance_name(),
            parsed_addresses=self.addresses,
            port=self.port,
            properties=advert.to_txt(),
            server=f"{advert.node_id}.local.",
        )

    def _register(self) -> None:
        with self._lock:
            if self._closed or self._latest is None:
                return
            try:
                if self.loopback_only:
                    self._zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
                else:
                    self._zc = Zeroconf(interfaces=InterfaceChoice.All)
                info = self._service(self._latest)
                try:
                    self._zc.register_service(info)
                except NonUniqueNameException:
                    log.warning("Bonjour name %s is taken; registering a variant", info.name)
                    self._zc.register_service(info, allow_name_change=True)
                self._info = info
            except Exception as e:  # multicast unavailable: serve without discovery
                log.warning("Bonjour advertisement failed (use a static worker list): %s", e)

    def _update(self) -> None:
        with self._lock:
            if self._closed or self._zc is None or self._info is None or not self._latest:
                return
            info = self._service(self._latest)
            info.name = self._info.name  # keep a name changed by a conflict
            try:
                self._zc.update_service(info)
                self._info = info
            except Exception as e:
                log.warning("could not update the Bonjour advertisement: %s", e)
