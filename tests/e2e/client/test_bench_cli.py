"""`wedlm bench`, run as a user runs it (a real `wedlm` process) against real servers: a
tiny cluster (coordinator with the first layers + one worker, gRPC and HTTP), a second
OpenAI-compatible server (another coordinator's HTTP API) and a closed port."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster_harness import (
    cluster_name,
    free_port,
    http_coordinator,
    start_coordinator,
    start_worker,
)

SECRET = "bench-test-secret"
WEDLM = [sys.executable, "-m", "wedlm_client.cli", "bench"]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*WEDLM, *args], capture_output=True, text=True, timeout=timeout)


def bench_json(*args: str) -> tuple[dict, str]:
    """Runs with --json: stdout must be exactly one JSON object (progress goes to stderr)."""
    out = bench(*args, "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), out.stderr


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("wedlm_qwen2", seed=43, num_hidden_layers=4)


@pytest.fixture(scope="module")
def cluster(model):
    name = cluster_name()
    env = {"WEDLM_SECRET": SECRET}
    procs = []
    try:
        worker, worker_address = start_worker(model, name, "--layers", "2-3", "--no-bonjour",
                                              env=env)  # fmt: skip
        procs.append(worker)
        coord, address = start_coordinator(
            model, name, "--no-bonjour", "--worker", worker_address, "--expect", "1",
            "--layers", "0-1", "--http-port", "0", "--secret", SECRET,
        )  # fmt: skip
        procs.append(coord)
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        coord.expect("serving")
        yield {"address": address, "http": http, "worker": worker_address}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def second(model):
    with http_coordinator(model) as server:
        yield server.http


@pytest.mark.parametrize("command", ["serve", "latency", "links", "fetch"])
def test_help_of_each_subcommand(command):
    out = bench(command, "--help", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: wedlm bench {command}")
    assert "--json" in out.stdout and "--out" in out.stdout


def test_bench_without_a_subcommand_or_with_a_bad_target_says_why(tmp_path):
    out = bench(timeout=60)
    assert out.returncode == 2 and "serve" in out.stderr
    out = bench("serve", "--target", "nowhere", "--out", str(tmp_path), timeout=60)
    assert out.returncode == 1
    assert "target 'nowhere': expected http(s)://HOST:PORT" in out.stderr
    out = bench("serve", "--target", "a=127.0.0.1:1", "--target", "a=127.0.0.1:2", timeout=60)
    assert out.returncode == 1 and "target names must differ" in out.stderr
    out = bench("serve", "--target", "a", "--concurrency", "0", timeout=60)
    assert out.returncode == 2 and "must be > 0" in out.stderr


def test_a_closed_port_is_counted_as_failures_not_a_crash(tmp_path):
    port = free_port()  # nothing listens there once the probe socket closed
    out = bench("serve", "--target", f"down=http://127.0.0.1:{port}/v1",
                "--target", f"grpc-down=127.0.0.1:{port}", "--requests", "3", "--warmup", "0",
                "--rounds", "1", "--concurrency", "2", "--client-processes", "1",
                "--out", str(tmp_path), timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed" in out.stdout.splitlines()[3]  # the table's header, after labels
    result = json.loads((tmp_path / "serve.json").read_text())
    runs = result["levels"]["2"]["rounds"][0]
    assert runs["down"]["sent"] == runs["down"]["failed"] == 3
    assert runs["down"]["failures"] == {"APIConnectionError": 3}
    assert runs["grpc-down"]["sent"] == runs["grpc-down"]["failed"] == 3
    assert runs["grpc-down"]["failures"] == {"UNAVAILABLE": 3}
    assert "error" in result["targets"]["grpc-down"]["label"]


def test_serve_against_a_cluster_and_a_second_server(cluster, second, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    result, progress = bench_json(
        "serve", "--target", f"ours={cluster['address']}", "--target", f"second={second}",
        "--target", f"ours-http={cluster['http']}", "--target", f"dead={dead}",
        "--concurrency", "1", "2", "--requests", "3", "--warmup", "0", "--rounds", "2",
        "--max-tokens", "8", "--client-processes", "1", "--out", str(tmp_path),
        "--label-cluster", cluster["address"],
    )  # fmt: skip
    assert result["tool"] == "wedlm bench serve" and result["schema"] == 1
    assert progress.count("[serve ") == 2 * 2 * 4  # a line per run, on stderr
    ours = result["targets"]["ours"]
    assert ours["kind"] == "grpc" and ours["model"] == ours["label"]["model"]
    assert ours["label"]["layers"] == 4 and ours["label"]["state"] == "serving"
    members = ours["label"]["members"]
    assert [m["layers"] for m in members] == ["0-1", "2-3"]
    assert members[1]["address"] == cluster["worker"] and ours["label"]["chips"]
    assert result["targets"]["second"]["kind"] == "openai"
    assert result["targets"]["ours-http"]["label"]["cluster"]["members"] == members
    assert set(result["levels"]) == {"1", "2"}
    for c, lv in result["levels"].items():
        assert len(lv["rounds"]) == 2
        assert lv["rounds"][1]["order"] == lv["rounds"][0]["order"][::-1]  # ABAB
        for rnd in lv["rounds"]:
            for name in ("ours", "second", "ours-http"):
                run = rnd[name]
                assert (run["sent"], run["ok"], run["failed"]) == (3, 3, 0), (c, name, run)
                assert run["tok_s"] > 0 and run["ttft_ms_p50"] > 0
                assert run["ttft_ms_p50"] <= run["ttft_ms_p90"] <= run["ttft_ms_p99"]
            assert (rnd["dead"]["sent"], rnd["dead"]["failed"]) == (3, 3)
        assert lv["median"]["ours"]["sent"] == 6 and lv["median"]["dead"]["failed"] == 6
        assert lv["rounds"][0]["ours"]["tokens_per_forward_p50"] > 0  # gRPC's own stats
        assert lv["compare"]["of"] == "second / ours" and lv["compare"]["tok_s"] > 0
    assert json.loads((tmp_path / "serve.json").read_text())["levels"] == result["levels"]
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_latency_by_mode(cluster, tmp_path):
    result, _ = bench_json("latency", "--cluster", cluster["address"], "--modes", "ar", "wedlm",
                           "diffusion", "--requests", "2", "--warmup", "0", "--max-tokens", "8",
                           "--out", str(tmp_path))  # fmt: skip
    assert result["cluster"]["members"][1]["address"] == cluster["worker"]
    for mode in ("ar", "wedlm"):
        m = result["modes"][mode]
        assert (m["sent"], m["failed"]) == (2, 0), m
        assert m["ttft_ms_p50"] > 0 and m["tokens_per_forward_p50"] > 0  # the coordinator's
        assert m["mode_run"] == [mode]
    diffusion = result["modes"]["diffusion"]  # not a diffusion model: refused, counted
    assert (diffusion["sent"], diffusion["failed"]) == (2, 2), diffusion
    assert (tmp_path / "latency.png").exists()


def test_links_shows_each_stage(cluster, tmp_path):
    result, _ = bench_json("links", "--cluster", cluster["address"], "--requests", "2",
                           "--out", str(tmp_path))  # fmt: skip
    (hop,) = result["hops"]
    assert hop["to"] == cluster["worker"] and hop["layers"] == "2-3"
    assert hop["roundtrip_ms"] > 0 and hop["roundtrip_ms"] >= hop["compute_ms"]
    assert "256 KiB" in result["not_measured"]


def test_fetch_against_a_raw_copy(cluster, model, tmp_path):
    result, _ = bench_json("fetch", "--cluster", cluster["address"], "--secret", SECRET,
                           "--copy-from", str(model), "--repeats", "1", "--out", str(tmp_path),
                           "--scratch", str(tmp_path))  # fmt: skip
    assert result["mb_per_s"]["fetch"]["median"] > 0
    assert result["mb_per_s"]["raw_copy"]["median"] > 0
    assert result["fetch_vs_raw_copy"] > 0
    assert (tmp_path / "fetch.png").exists()
