"""Workers without a model folder fetch their layers from the coordinator, with real
processes on 127.0.0.1: the cluster's greedy tokens equal the single-process engine's, a
worker's cache holds only its range, a restart reuses the cache and fetches again only a
corrupted file, a killed fetch resumes, a re-plan fetches what moved, a worker follows a
coordinator that changes model, and fetches need the cluster's credentials."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from common.call_auth import call_metadata
from common.checkpoint_weights import layer_file_name
from common.generation_params import GenerationParams
from common.model_config import load_model_config
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from coordinator.model_source.layer_files import LayerFiles
from tests.support.cluster_harness import (
    cluster_name,
    engine_outputs,
    free_port,
    spawn,
    start_coordinator,
    start_fetching_worker,
    wait_until,
)
from wedlm_client.client import WedlmClient
from wedlm_client.status_view import format_status

SECRET = "fetch-secret"
JOBS = [
    ("the cat sat on the mat", GenerationParams(threshold=1.5, max_tokens=16)),
    ("count 1 2 3", GenerationParams(mode="ar", max_tokens=16)),
]
SECRET_ENV = {"WEDLM_SECRET": SECRET}


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen3", seed=71, num_hidden_layers=6)


@pytest.fixture(scope="module")
def expected(model):
    return engine_outputs(model, JOBS)


def generate_all(address: str, jobs=JOBS) -> list[list[int]]:
    with WedlmClient(address, timeout=120) as client:
        return [client.generate(text=text, params=params)["tokens"] for text, params in jobs]


def serving_ranges(address: str) -> dict[str, tuple[int, int]]:
    with WedlmClient(address, timeout=30) as client:
        st = client.cluster_status()
    return {
        w.address: (w.info.layer_start, w.info.layer_end)
        for w in st.workers
        if w.health == "serving" and w.info.has_layers
    }


def cached_files(cache: Path, model: Path) -> dict[str, Path]:
    folder = cache / load_model_config(model).identity
    return {f.name: f for f in folder.iterdir()} if folder.is_dir() else {}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()




def stop_all(procs) -> None:
    for p in procs:
        p.stop()


def start_cluster(model, caches: list[Path], *coord_flags: str, worker_flags=()):
    """Fetching workers (one per cache folder) and a coordinator: the processes (the
    coordinator last), its address and the workers' addresses."""
    name = cluster_name()
    procs, workers = [], []
    for cache in caches:
        proc, address = start_fetching_worker(name, cache, *worker_flags, env=SECRET_ENV)
        procs.append(proc)
        workers.append(address)
    listed = [flag for w in workers for flag in ("--worker", w)]
    coord, address = start_coordinator(
        model, name, "--no-bonjour", "--expect", str(len(caches)), "--secret", SECRET,
        *listed, *coord_flags,
    )  # fmt: skip
    procs.append(coord)
    return procs, address, workers


def layer_names(cache: Path, model: Path) -> set[str]:
    return {n for n in cached_files(cache, model) if n.startswith("model-layer-")}


def layer_number(name: str) -> int:
    return int(name[len("model-layer-") : -len(".safetensors")])


def test_fetching_workers_serve_reuse_their_cache_and_refetch_a_corrupted_file(
    model, expected, tmp_path
):
    files = LayerFiles(model, 6)
    caches = [tmp_path / "w1", tmp_path / "w2"]
    procs, address, workers = start_cluster(model, caches, "--layers", "0-1")
    try:
        procs[-1].expect("serving")
        assert generate_all(address) == expected
        ranges = serving_ranges(address)
    finally:
        stop_all(procs)
    assert sorted(ranges.values())[0][0] == 2 and sorted(ranges.values())[-1][1] == 5
    for cache, worker in zip(caches, workers, strict=True):
        start, end = ranges[worker]
        found = cached_files(cache, model)
        assert layer_names(cache, model) == {layer_file_name(i) for i in range(start, end + 1)}
        for layer in range(start, end + 1):
            path = found[layer_file_name(layer)]
            assert path.stat().st_size == files[layer].size
            assert sha256(path) == files.sha256(layer)
        assert not [n for n in found if n.endswith(".part")]

    # A restart reuses the cache; a corrupted file (same size) is detected and fetched again.
    first = cached_files(caches[0], model)
    victim = sorted(layer_names(caches[0], model))[0]
    data = bytearray(first[victim].read_bytes())
    data[-1] ^= 0xFF
    first[victim].write_bytes(data)
    before = {n: p.stat().st_mtime_ns for c in caches for n, p in cached_files(c, model).items()}
    procs, address, _ = start_cluster(
        model, caches, "--layers", "0-1", worker_flags=("--log-level", "INFO")
    )
    try:
        procs[-1].expect("serving")
        assert generate_all(address) == expected
    finally:
        stop_all(procs)
    assert "does not match its checksum" in "".join(procs[0].log)
    after = {n: p.stat().st_mtime_ns for c in caches for n, p in cached_files(c, model).items()}
    changed = {n for n in after if n.startswith("model-layer-") and after[n] != before[n]}
    assert changed == {victim}
    assert sha256(cached_files(caches[0], model)[victim]) == files.sha256(layer_number(victim))


@pytest.fixture(scope="module")
def wide_model(checkpoint_dir):
    """Layers of ~16 MB, so that a paced fetch takes seconds and can be interrupted, and
    is much longer than what gRPC's flow control lets the coordinator send ahead (its
    progress counts bytes handed to gRPC)."""
    return checkpoint_dir(
        "qwen3", seed=72, num_hidden_layers=2, hidden_size=512, intermediate_size=2048
    )


def _reported_fetch(address: str) -> dict | None:
    with WedlmClient(address, timeout=30) as client:
        st = client.status_dict()
    fetches = st.get("fetches", [])
    return st if fetches and int(fetches[0].get("bytes_done", 0)) > 0 else None




def test_a_killed_fetch_resumes_and_ends_with_the_same_checksums(wide_model, tmp_path):
    cache, port = tmp_path / "w", free_port()
    name = cluster_name()
    flags = ("--port", str(port), "--log-level", "INFO")
    worker, address = start_fetching_worker(
        name, cache, *flags, "--fetch-limit-mbps", "64", env=SECRET_ENV
    )  # 8 MB/s: a few seconds for the range
    coord, coord_address = start_coordinator(
        wide_model, name, "--no-bonjour", "--no-local-layers", "--secret", SECRET,
        "--worker", address, "--metrics-port", "0",
    )  # fmt: skip
    metrics_url = coord.expect(r"metrics on (http://\S+)").group(1)
    procs = [worker, coord]
    try:
        folder = cache / load_model_config(wide_model).identity
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            parts = list(folder.glob("*.part")) if folder.is_dir() else []
            if parts and parts[0].stat().st_size > 256 << 10:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the fetch never started")
        # progress is visible in the status (as the worker reports it, about every
        # second) and the metrics while it runs
        st = wait_until(lambda: _reported_fetch(coord_address), 30, "a progress report", 0.1)
        (fetch,) = st["fetches"]
        assert fetch["node_id"] and 0 < int(fetch["bytes_done"]) < int(fetch["bytes_total"])
        assert "fetching layers: " in format_status(st)
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert "wedlm:layer_fetches_active 1.0" in text
        sent = re.search(r"^wedlm:layer_fetch_bytes_total (\S+)$", text, re.MULTILINE)
        assert float(sent.group(1)) > 0
        worker.popen.send_signal(signal.SIGKILL)
        worker.popen.wait(10)
        partial = parts[0].stat().st_size
        files = LayerFiles(wide_model, 2)
        assert 0 < partial < files[0].size + files[1].size
        worker, _ = start_fetching_worker(name, cache, *flags, env=SECRET_ENV)
        procs[0] = worker
        coord.expect("serving")
        jobs = [("resume", GenerationParams(mode="ar", max_tokens=8))]
        assert generate_all(coord_address, jobs) == engine_outputs(wide_model, jobs)
    finally:
        stop_all(procs)
    assert "resuming layer" in "".join(worker.log)
    for layer in (0, 1):
        assert sha256(folder / layer_file_name(layer)) == files.sha256(layer)
    assert not list(folder.glob("*.part"))


def test_a_replan_after_a_loss_fetches_the_layers_that_moved(model, tmp_path):
    jobs = [
        (f"stream {i} says {w}", GenerationParams(mode="ar" if i % 2 else "wedlm",
                                                  threshold=1.0, max_tokens=120))
        for i, w in enumerate("abcd")
    ]  # fmt: skip
    want = engine_outputs(model, jobs)
    caches = [tmp_path / "w1", tmp_path / "w2"]
    procs, address, workers = start_cluster(model, caches, "--layers", "0-1")
    results: dict[int, list[int]] = {}
    progress = [0] * len(jobs)

    def run(i: int) -> None:
        text, params = jobs[i]
        with WedlmClient(address, timeout=300) as client:
            for event in client.generate_stream(text=text, params=params):
                if event[0] == "tokens":
                    progress[i] += len(event[1])
                else:
                    results[i] = event[1]

    try:
        procs[-1].expect("serving")
        ranges = serving_ranges(address)
        victim = workers.index(max(ranges, key=lambda a: ranges[a][0]))  # the last stage
        held = {n: p.stat().st_mtime_ns for n, p in cached_files(caches[1 - victim], model).items()}
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(progress) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert min(progress) >= 4 and max(progress) < 100, progress  # the loss hits mid-stream
        procs[victim].popen.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(300)
        after = serving_ranges(address)
    finally:
        stop_all(procs)
    assert [results[i]["tokens"] for i in range(len(jobs))] == want
    assert after == {workers[1 - victim]: (2, 5)}
    survivor = caches[1 - victim]
    assert layer_names(survivor, model) == {layer_file_name(i) for i in range(2, 6)}
    now = {n: p.stat().st_mtime_ns for n, p in cached_files(survivor, model).items()}
    kept = {n for n in held if n.startswith("model-layer-")}
    assert kept and all(now[n] == held[n] for n in kept)  # only the missing ones were fetched


def test_a_fetching_worker_follows_a_coordinator_that_changes_model(
    model, checkpoint_dir, expected, tmp_path
):
    other = checkpoint_dir("qwen3", seed=73, num_hidden_layers=4)
    cache = tmp_path / "w"
    name = cluster_name()
    worker, address = start_fetching_worker(name, cache, env=SECRET_ENV)
    procs = [worker]
    try:
        for served, jobs, want in ((model, JOBS, expected), (other, JOBS[1:], None)):
            coord, coord_address = start_coordinator(
                served, name, "--no-bonjour", "--no-local-layers", "--secret", SECRET,
                "--worker", address,
            )  # fmt: skip
            coord.expect("serving")
            got = generate_all(coord_address, jobs)
            coord.stop()
            assert got == (want or engine_outputs(served, jobs))
            # without a cap, only the model in use stays in the cache
            assert [p.name for p in cache.iterdir()] == [load_model_config(served).identity]
    finally:
        stop_all(procs)


def _manifest(address: str, secret: str | None, identity: str, layers=(0,)):
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ModelSourceStub(channel)
        md = call_metadata(secret, "/wedlm.v1.ModelSource/LayerManifest", identity)
        return stub.LayerManifest(pb.LayerManifestRequest(layers=list(layers)), metadata=md,
                                  timeout=30)  # fmt: skip


def _fetch(address: str, secret: str | None, identity: str, layer: int, offset: int = 0):
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ModelSourceStub(channel)
        md = call_metadata(secret, "/wedlm.v1.ModelSource/FetchLayer", identity)
        request = pb.FetchLayerRequest(layer=layer, offset=offset)
        return list(stub.FetchLayer(request, metadata=md, timeout=30))


def test_fetches_need_the_cluster_credentials_and_valid_ranges(model):
    identity = load_model_config(model).identity
    coord, address = start_coordinator(
        model, cluster_name(), "--no-bonjour", "--secret", SECRET, "--api-key", "client-key"
    )
    try:
        coord.expect("serving")
        for secret, wanted in ((None, "missing"), ("wrong", "wrong cluster secret")):
            with pytest.raises(grpc.RpcError) as e:
                _manifest(address, secret, identity)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and wanted in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                _fetch(address, secret, identity, 0)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            _manifest(address, SECRET, "0123456789abcdef")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model identity" in e.value.details()
        for layers in ((6,), (-1,)):
            with pytest.raises(grpc.RpcError) as e:
                _manifest(address, SECRET, identity, layers)
            assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
        # the cluster secret is enough: workers do not hold the clients' API key
        reply = _manifest(address, SECRET, identity, (0, 5))
        files = LayerFiles(model, 6)
        assert [(f.layer, f.size) for f in reply.files] == [(0, files[0].size), (5, files[5].size)]
        assert reply.model_identity == identity
        assert json.loads(reply.config_json) == load_model_config(model).raw
        chunks = _fetch(address, SECRET, identity, 5)
        body = b"".join(c.data for c in chunks)
        assert chunks[-1].sha256 == hashlib.sha256(body).hexdigest() == files.sha256(5)
        tail = _fetch(address, SECRET, identity, 5, offset=1000)
        assert b"".join(c.data for c in tail) == body[1000:]
        with pytest.raises(grpc.RpcError) as e:
            _fetch(address, SECRET, identity, 5, offset=len(body) + 1)
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    finally:
        coord.stop()


def _hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """A Hugging Face hub cache holding `model` as `repo_id`, laid out as huggingface_hub
    writes it: content-addressed blobs, a snapshot of links to them, refs/main."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in model.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return root


def test_a_coordinator_serves_a_model_from_the_hub_cache_to_a_worker_that_joins_later(
    model, expected, tmp_path
):
    """The coordinator serves alone first; the worker that joins fetches its range while
    the coordinator keeps serving, then the re-plan takes it in."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(_hub_cache(tmp_path / "hub", "wedlm-tests/tiny", model)),
    }
    name, port = cluster_name(), free_port()
    coord, coord_address = start_coordinator(
        "wedlm-tests/tiny", name, "--no-bonjour", "--secret", SECRET,
        "--worker", f"127.0.0.1:{port}", env=env,
    )  # fmt: skip
    procs = [coord]
    try:
        coord.expect("serving wedlm-tests/tiny: coordinator")
        assert generate_all(coord_address) == expected
        worker, _ = start_fetching_worker(name, tmp_path / "w", "--port", str(port),
                                                env=SECRET_ENV)  # fmt: skip
        procs.append(worker)
        coord.expect("fetches layers .* before the re-plan")
        deadline = time.monotonic() + 60
        while not serving_ranges(coord_address) and time.monotonic() < deadline:
            time.sleep(0.2)
        ((start, end),) = serving_ranges(coord_address).values()
        assert end == 5 and layer_names(tmp_path / "w", model) == {
            layer_file_name(i) for i in range(start, 6)
        }
        assert generate_all(coord_address) == expected
        with WedlmClient(coord_address, timeout=30) as client:
            assert client.model_info().model_name == "wedlm-tests/tiny"
    finally:
        stop_all(procs)
    code, out = start_coordinator_failure("wedlm-tests/absent", env)
    assert code == 1 and "not in the Hugging Face cache" in out


def start_coordinator_failure(model: str, env: dict[str, str]) -> tuple[int, str]:
    proc = spawn(
        "coordinator.service.server_cli", "serve", "--model", model, "--port", "0",
        "--state-dir", "none", "--no-bonjour", env=env,
    )  # fmt: skip
    return proc.wait_exit(120)


def test_a_cache_cap_too_small_for_the_range_is_reported(model, tmp_path):
    name = cluster_name()
    worker, address = start_fetching_worker(
        name, tmp_path / "w", "--cache-max-gb", "0.0001", env=SECRET_ENV
    )
    coord, coord_address = start_coordinator(
        model, name, "--no-bonjour", "--no-local-layers", "--secret", SECRET,
        "--worker", address,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with WedlmClient(coord_address, timeout=30) as client:
                st = client.cluster_status()
            if "cache's cap" in st.waiting_for:
                break
            time.sleep(0.3)
        assert "RESOURCE_EXHAUSTED" in st.waiting_for and "--cache-max-gb" in st.waiting_for
        assert st.state == "waiting-for-workers"
    finally:
        stop_all([worker, coord])


def test_worker_cache_flags(model, tmp_path):
    cache = tmp_path / "c"
    (cache / "0123456789abcdef").mkdir(parents=True)
    (cache / "0123456789abcdef" / layer_file_name(0)).write_bytes(b"x" * 5_000_000)
    code, out = spawn("shard_worker.cli", "--clear-cache", "--cache-dir", str(cache)).wait_exit()
    assert code == 0 and "removed 5.0 MB" in out and not list(cache.iterdir())
    for flags, wanted in (
        (["--cache-max-gb", "0"], "expected a positive number of GB"),
        (["--cache-max-gb", "nan"], "expected a positive number of GB"),
        (["--fetch-limit-mbps", "-3"], "megabits per second"),
    ):
        code, out = spawn("shard_worker.cli", *flags).wait_exit()
        assert code == 2 and wanted in out, out
    code, out = spawn("shard_worker.cli", "--model", str(model), "--cache-dir", "x").wait_exit()
    assert code == 1 and "for workers without --model" in out
