"""Bonjour advertisements are spoofable: a coordinator checks every advertised worker on
connect. Spoofed ones (another protocol, a worker with another secret or model behind a
well-formed record) are rejected, listed in ClusterStatus, and never used."""

from __future__ import annotations

import socket
import time
from dataclasses import replace

from zeroconf import IPVersion, ServiceInfo, Zeroconf

from common.call_auth import PROTOCOL_VERSION
from common.discovery_record import SERVICE_TYPE, WorkerAdvert
from common.generation_params import GenerationParams
from common.model_config import load_model_config
from tests.support.cluster_harness import cluster_name, start_coordinator, start_worker
from wedlm_client.client import WedlmClient


def register(zc: Zeroconf, advert: WorkerAdvert, port: int) -> ServiceInfo:
    info = ServiceInfo(
        SERVICE_TYPE,
        advert.instance_name(),
        addresses=[socket.inet_aton("127.0.0.1")],
        port=port,
        properties=advert.to_txt(),
        server=f"{advert.node_id}.local.",
    )
    zc.register_service(info)
    return info


def test_spoofed_advertisements_are_rejected_and_reported(checkpoint_dir):
    model = checkpoint_dir("qwen3", seed=81, num_hidden_layers=2)
    other_model = checkpoint_dir("llama", seed=82, num_hidden_layers=2)
    name = cluster_name()
    identity = load_model_config(model).identity
    real, _ = start_worker(model, name, "--secret", "s")
    # Real processes behind forged records: another secret, another model.
    wrong_secret, ws_addr = start_worker(model, name, "--secret", "other", "--no-bonjour")
    foreign, f_addr = start_worker(other_model, name, "--secret", "s", "--no-bonjour")
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    base = WorkerAdvert(
        node_id="spoof",
        cluster=name,
        protocol=PROTOCOL_VERSION,
        device="cpu",
        memory_total=1 << 40,
        memory_available=1 << 40,
        layers="",
        model=identity,
        model_name="x",
    )
    procs = [real, wrong_secret, foreign]
    try:
        register(zc, replace(base, node_id=f"spoof-secret-{name}"), int(ws_addr.split(":")[1]))
        register(zc, replace(base, node_id=f"spoof-model-{name}"), int(f_addr.split(":")[1]))
        register(zc, replace(base, node_id=f"spoof-proto-{name}", protocol=99), 9)
        time.sleep(1.0)
        coord, address = start_coordinator(model, name, "--secret", "s", "--expect", "3")
        procs.append(coord)
        coord.expect("serving")
        with WedlmClient(address, timeout=60) as client:
            status = client.cluster_status()
            out = client.generate(text="hi", params=GenerationParams(mode="ar", max_tokens=4))
        by_health: dict[str, list] = {}
        for w in status.workers:
            by_health.setdefault(w.health, []).append(w)
        assert len(by_health["serving"]) == 1
        details = " | ".join(w.detail for w in by_health["rejected"])
        assert "UNAUTHENTICATED" in details  # the forged record in front of another secret
        assert "model" in details  # the one in front of another model
        assert "protocol" in details  # the record announcing another protocol
        assert out["finish_reason"] in ("length", "stop")
    finally:
        zc.close()
        for p in procs:
            p.stop()
