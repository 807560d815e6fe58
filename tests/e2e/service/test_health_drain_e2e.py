"""Health and shutdown: liveness and readiness over grpc.health.v1, and SIGTERM draining
(new work refused with UNAVAILABLE, running streams end with a final message)."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.generation_params import GenerationParams
from tests.support.cluster_harness import cluster_name, start_coordinator, start_worker
from wedlm_client.client import ClusterError, WedlmClient

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return reply.status


def test_readiness_and_sigterm_drain(checkpoint_dir):
    model = checkpoint_dir("qwen3", seed=61, num_hidden_layers=2, max_position_embeddings=4096)
    name = cluster_name()
    worker, _ = start_worker(model, name)
    coord, address = start_coordinator(model, name, "--drain-timeout", "1.5")
    try:
        assert health(address, "liveness") == SERVING
        coord.expect("serving")
        deadline = time.monotonic() + 10
        while health(address, "readiness") != SERVING and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health(address, "readiness") == SERVING
        events: list = []
        started = threading.Event()

        def long_stream() -> None:
            with WedlmClient(address, timeout=60) as client:
                params = GenerationParams(mode="ar", max_tokens=3500)
                for event in client.generate_stream(text="go", params=params):
                    events.append(event)
                    started.set()

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(30)
        coord.popen.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert health(address, "readiness") == NOT_SERVING
        with WedlmClient(address, timeout=10) as client, pytest.raises(ClusterError) as err:
            client.generate(text="late", params=GenerationParams(max_tokens=4))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        thread.join(30)
        final = events[-1]
        assert final[0] == "final" and final[1]["finish_reason"] == "shutdown"
        code, output = coord.wait_exit(30)
        assert code == 0 and "drained (1 unfinished jobs cancelled)" in output
    finally:
        worker.stop()
        coord.stop()
