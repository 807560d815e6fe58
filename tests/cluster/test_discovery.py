"""Discovery on loopback: real Bonjour advertisements (python-zeroconf bound to 127.0.0.1), the
static list, and the authenticated Info probe against a small in-process gRPC worker."""

from __future__ import annotations

import re
import socket
import time
import uuid
from concurrent import futures
from dataclasses import replace

import grpc
import pytest
from zeroconf import IPVersion, ServiceInfo, Zeroconf

from common.call_auth import PROTOCOL_VERSION, ClusterAuthInterceptor
from common.discovery_record import SERVICE_TYPE, WorkerAdvert
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from coordinator.cluster.discovery import (
    DiscoveredWorker,
    DiscoveryError,
    WorkerBrowser,
    WorkerProbeError,
    merge_candidates,
    parse_static,
    probe_worker,
    shortfall,
)
from tests.support.cluster_harness import free_port

RUN = uuid.uuid4().hex[:8]  # other test runs may share this loopback: keep our names apart
CLUSTER = f"test-{RUN}"


def advert(node: str, cluster: str = CLUSTER, **changes) -> WorkerAdvert:
    base = WorkerAdvert(
        node_id=f"{node}-{RUN}",
        cluster=cluster,
        protocol=PROTOCOL_VERSION,
        device="cpu",
        memory_total=64 << 30,
        memory_available=48 << 30,
        layers="",
        model="fingerprint",
        model_name="tiny",
    )
    return replace(base, **changes)


def service(node_id: str, port: int, txt: dict[str, str]) -> ServiceInfo:
    return ServiceInfo(
        SERVICE_TYPE,
        f"{node_id}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=port,
        properties=txt,
        server=f"{node_id}.local.",
    )


def eventually(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return result


@pytest.fixture(scope="module")
def responder():
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    yield zc
    zc.close()


def test_browser_keeps_this_clusters_workers(responder: Zeroconf):
    good, elsewhere = advert("good"), advert("other", cluster="elsewhere")
    broken = advert("broken").to_txt()
    del broken["model"]
    old = advert("old", protocol=PROTOCOL_VERSION + 1)
    services = [
        service(good.node_id, 41001, good.to_txt()),
        service(elsewhere.node_id, 41002, elsewhere.to_txt()),
        service(f"broken-{RUN}", 41003, broken),
        service(old.node_id, 41004, old.to_txt()),
    ]
    with WorkerBrowser(CLUSTER, loopback_only=True) as browser:
        for info in services:
            responder.register_service(info, cooperating_responders=True)
        try:
            found = eventually(browser.workers)
            assert found == [DiscoveredWorker("127.0.0.1:41001", "bonjour", good)]
            rejected = dict(eventually(lambda: len(browser.rejected()) >= 2 and browser.rejected()))
            assert rejected[f"broken-{RUN}.{SERVICE_TYPE}"] == (
                "malformed advertisement: advertisement lacks 'model'"
            )
            assert "speaks protocol" in rejected[f"{old.node_id}.{SERVICE_TYPE}"]
            ignored = dict(eventually(browser.ignored))
            assert ignored[f"{elsewhere.node_id}.{SERVICE_TYPE}"] == "elsewhere"
            assert browser.workers() == found  # the others never become workers

            # An update of the TXT record replaces the advert.
            fresh = replace(good, memory_available=1 << 30)
            responder.update_service(service(good.node_id, 41001, fresh.to_txt()))
            eventually(lambda: browser.workers()[0].advert == fresh)

            # A worker that unregisters disappears.
            responder.unregister_service(services[0])
            eventually(lambda: browser.workers() == [])
        finally:
            for info in services[1:]:
                responder.unregister_service(info)


def test_candidates_merge_static_and_bonjour(responder: Zeroconf):
    good = advert("merge")
    info = service(good.node_id, 41011, good.to_txt())
    static = parse_static(["127.0.0.1:41011", "127.0.0.1:41012"])
    with WorkerBrowser(CLUSTER, loopback_only=True) as browser:
        responder.register_service(info, cooperating_responders=True)
        try:
            deadline = time.monotonic() + 10
            while not browser.workers() and time.monotonic() < deadline:
                time.sleep(0.05)
            found = merge_candidates(static, browser.workers())
            # Static entries first, the same address counted once, its advert attached.
            assert found == [
                DiscoveredWorker("127.0.0.1:41011", "static", good),
                DiscoveredWorker("127.0.0.1:41012", "static", None),
            ]
            message = shortfall(found, 3, 0.3, browser)
            assert "found 2 of 3 workers within 0.3 s: 127.0.0.1:41011 (static)" in message
        finally:
            responder.unregister_service(info)


def test_shortfall_without_browser_names_the_listed_workers():
    static = parse_static(["10.0.0.1:5000"])
    assert merge_candidates(static, []) == static
    message = shortfall(static, 2, 60, None)
    assert "expected 2 workers but only 1 were listed: 10.0.0.1:5000 (static)" in message


def test_parse_static():
    assert [w.address for w in parse_static(["a.local:1", "[::1]:50051", "a.local:1 "])] == [
        "a.local:1",
        "[::1]:50051",
    ]
    assert all(w.source == "static" and w.advert is None for w in parse_static(["h:2"]))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("10.0.0.1", "no port"),
        (":5000", "no host"),
        ("host:0", "port '0' is not a number from 1 to 65535"),
        ("host:70000", "from 1 to 65535"),
        ("host:http", "port 'http'"),
        ("::1:5000", "IPv6 host in brackets"),
        ("[nope]:5000", "not an IPv6 address"),
        ("300.1.2.3:5000", "not an IPv4 address"),
        ("bad host:5000", "not a host name"),
    ],
)
def test_parse_static_errors(text: str, why: str):
    with pytest.raises(
        DiscoveryError, match=re.escape(f"invalid worker address {text!r}") + ".*" + why
    ):
        parse_static(["ok.local:1", text])


# ---- probe -----------------------------------------------------------------------------


class FakeWorker(pb_grpc.WorkerServicer):
    def Info(self, request, context):
        return pb.WorkerInfo(
            node_id="n1", cluster=CLUSTER, protocol_version=PROTOCOL_VERSION,
            model_identity="model-A", num_layers=4,
        )  # fmt: skip


@pytest.fixture(scope="module")
def worker_address():
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        interceptors=[ClusterAuthInterceptor("s3cret", "model-A")],
    )
    pb_grpc.add_WorkerServicer_to_server(FakeWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_probe_returns_info(worker_address: str):
    info = probe_worker(worker_address, "s3cret", "model-A", timeout_s=5)
    assert (info.node_id, info.num_layers) == ("n1", 4)


def test_probe_refused_by_the_worker(worker_address: str):
    with pytest.raises(WorkerProbeError) as err:
        probe_worker(worker_address, "wrong", "model-A", timeout_s=5)
    assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert str(err.value) == f"worker {worker_address}: UNAUTHENTICATED: wrong cluster secret"
    with pytest.raises(WorkerProbeError, match="FAILED_PRECONDITION: model identity 'model-B'"):
        probe_worker(worker_address, "s3cret", "model-B", timeout_s=5)




def test_probe_dead_address_fails_within_timeout():
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(WorkerProbeError) as err:
        probe_worker(address, "s3cret", "model-A", timeout_s=2)
    assert time.monotonic() - start < 3
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert str(err.value).startswith(f"worker {address}: ")


def test_probe_silent_listener_hits_the_deadline():
    with socket.socket() as silent:  # accepts connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(WorkerProbeError) as err:
            probe_worker(address, None, "model-A", timeout_s=1)
        assert time.monotonic() - start < 2.5
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
