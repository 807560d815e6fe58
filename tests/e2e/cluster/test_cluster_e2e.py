"""The distributed service end to end: real worker and coordinator processes on 127.0.0.1,
real gRPC and real Bonjour on loopback. Distributed output equals the single-process
engine's, token for token (float32 tiny checkpoints, greedy)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import grpc
import pytest

from common.generation_params import GenerationParams
from common.proto_gen import wedlm_pb2 as pb
from tests.support.cluster_harness import (
    cluster_name,
    engine_outputs,
    start_coordinator,
    start_worker,
)
from wedlm_client.client import ClusterError, WedlmClient

PROMPTS = ["the cat sat on the mat", "count 1 2 3"]
SETTINGS = [
    GenerationParams(threshold=1.5, max_tokens=24),
    GenerationParams(window=4, threshold=None, penalty=0.1, max_tokens=16),
    GenerationParams(mode="ar", max_tokens=20),
]


def local_outputs(model, prompts=PROMPTS, settings=SETTINGS) -> list[list[int]]:
    return engine_outputs(model, [(t, p) for t in prompts for p in settings])


def cluster_outputs(address, prompts=PROMPTS, settings=SETTINGS) -> list[list[int]]:
    with WedlmClient(address, timeout=120) as client:
        return [client.generate(text=t, params=p)["tokens"] for t in prompts for p in settings]


@pytest.fixture(scope="module")
def model5(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen3", seed=21, num_hidden_layers=5)


@pytest.fixture(scope="module")
def bonjour_cluster(model5):
    """Two workers without --layers, found over Bonjour; the coordinator assigns ranges."""
    name = cluster_name()
    procs = []
    try:
        for _ in range(2):
            procs.append(start_worker(model5, name)[0])
        coord, address = start_coordinator(model5, name, "--expect", "2")
        procs.append(coord)
        coord.expect(r"serving")
        yield address
    finally:
        for p in procs:
            p.stop()


def test_two_workers_over_bonjour_match_single_process(bonjour_cluster, model5):
    assert cluster_outputs(bonjour_cluster) == local_outputs(model5)
    with WedlmClient(bonjour_cluster) as client:
        status = client.cluster_status()
    serving = [w for w in status.workers if w.health == "serving"]
    assert status.state == "serving" and len(serving) == 2
    ranges = sorted((w.info.layer_start, w.info.layer_end) for w in serving)
    own = [int(x) for x in status.local_layers.split("-")]  # the coordinator's, first
    ranges = [tuple(own), *ranges]
    assert ranges[0][0] == 0 and ranges[-1][1] == 4
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(ranges))
    # protocol 3: each stage knows its successor; the last answers the coordinator
    by_start = sorted(serving, key=lambda w: w.info.layer_start)
    assert by_start[0].info.next_stage == by_start[1].address
    assert by_start[1].info.next_stage == ""
    assert {w.info.plan_epoch for w in serving} == {status.plan_epoch}
    assert all(w.source == "bonjour" for w in serving)
    assert all(w.timing.roundtrip_s > 0 for w in serving)


def test_submit_and_wait_job(bonjour_cluster, model5):
    params = SETTINGS[0]
    with WedlmClient(bonjour_cluster) as client:
        job_id = client.submit(text=PROMPTS[0], params=params)
        job = client.wait_job(job_id, timeout_s=60)
        assert job.state == "done"
        assert list(job.result.tokens) == local_outputs(model5, PROMPTS[:1], [params])[0]
        assert client.get_job(job_id).state == "done"
        with pytest.raises(ClusterError) as err:
            client.get_job("no-such-job")
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_bad_requests_get_invalid_argument(bonjour_cluster):
    with WedlmClient(bonjour_cluster) as client:
        for req in (
            pb.GenerateRequest(text="x", window=0),
            pb.GenerateRequest(text="x", top_p=1.5),
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])),
            pb.GenerateRequest(),
        ):
            with pytest.raises(grpc.RpcError) as err:
                list(client.stub.Generate(req, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = client.model_info()
        assert info.num_layers == 5 and info.mask_token_id > 0


def test_cli_against_the_cluster(bonjour_cluster, model5):
    run = [sys.executable, "-m", "wedlm_client.cli"]
    out = subprocess.run(
        [
            *run,
            "generate",
            "--cluster",
            bonjour_cluster,
            "--prompt",
            PROMPTS[1],
            "--mode",
            "ar",
            "--max-tokens",
            "20",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tokens"] == local_outputs(model5, PROMPTS[1:], SETTINGS[2:])[0]
    status = subprocess.run(
        [*run, "status", "--cluster", bonjour_cluster], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0 and "serving" in status.stdout


def test_three_fixed_workers_static_list_uneven(checkpoint_dir):
    model = checkpoint_dir("qwen3_moe", seed=22, num_hidden_layers=5)
    name = cluster_name()
    procs, addresses = [], []
    try:
        for layers in ("0-0", "1-3", "4-4"):
            proc, address = start_worker(model, name, "--layers", layers, "--no-bonjour")
            procs.append(proc)
            addresses.append(address)
        extra = [a for addr in reversed(addresses) for a in ("--worker", addr)]
        coord, address = start_coordinator(model, name, "--no-bonjour", "--expect", "3", *extra)
        procs.append(coord)
        coord.expect(r"serving")
        assert cluster_outputs(address) == local_outputs(model)
    finally:
        for p in procs:
            p.stop()


def test_secret_and_foreign_model_workers_are_rejected(checkpoint_dir, model5):
    other = checkpoint_dir("llama", seed=23, num_hidden_layers=5)
    name = cluster_name()
    procs = []
    try:
        good, good_addr = start_worker(model5, name, "--no-bonjour", "--secret", "right")
        wrong, wrong_addr = start_worker(model5, name, "--no-bonjour", "--secret", "wrong")
        foreign, foreign_addr = start_worker(other, name, "--no-bonjour", "--secret", "right")
        procs += [good, wrong, foreign]
        coord, address = start_coordinator(
            model5,
            name,
            "--no-bonjour",
            "--secret",
            "right",
            "--expect",
            "3",
            "--worker",
            good_addr,
            "--worker",
            wrong_addr,
            "--worker",
            foreign_addr,
        )
        procs.append(coord)
        coord.expect(r"serving")
        with WedlmClient(address) as client:
            status = {w.address: w for w in client.cluster_status().workers}
            assert status[good_addr].health == "serving"
            assert status[wrong_addr].health == "rejected"
            assert "UNAUTHENTICATED" in status[wrong_addr].detail
            assert status[foreign_addr].health == "rejected"
            assert "model" in status[foreign_addr].detail
            out = client.generate(text="hi", params=GenerationParams(mode="ar", max_tokens=5))
            assert out["finish_reason"] in ("length", "stop")
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        (("0-1", "3-4"), "layer 2 is held by no worker"),
        (("0-2", "2-4"), "held by both"),
        (("0-2", "3-4", "4-4"), "held by both"),
    ],
)
def test_bad_tilings_are_reported(model5, ranges, message):
    name = cluster_name()
    procs, extra = [], []
    try:
        for layers in ranges:
            proc, address = start_worker(model5, name, "--layers", layers, "--no-bonjour")
            procs.append(proc)
            extra += ["--worker", address]
        # A gap may yet be filled by a worker that starts later: the coordinator waits
        # (--wait-for-workers) before it says so; overlapping ranges stop it at once.
        coord, _ = start_coordinator(
            model5,
            name,
            "--no-bonjour",
            "--expect",
            str(len(ranges)),
            "--wait-for-workers",
            "4",
            *extra,
        )
        procs.append(coord)
        code, output = coord.wait_exit(120)
        assert code == 1 and message in output, output
        assert "Traceback" not in output
    finally:
        for p in procs:
            p.stop()
