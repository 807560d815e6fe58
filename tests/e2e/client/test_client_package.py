"""The client install: `pip install "wedlm-cluster[client]"` into a fresh virtual
environment brings no MLX (nor numpy, transformers), and from there `wedlm_client` and the
`wedlm` CLI stream, submit and wait on a real coordinator; the serving commands say
which extra they need instead of failing on an import."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.cluster_harness import cluster_name, start_coordinator
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
SOURCES = ("pyproject.toml", "README.md", "common", "coordinator", "shard_worker", "wedlm_client")
KEY = "client-key"

CLIENT_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    assert importlib.util.find_spec("mlx") is None, "mlx is installed"
    from wedlm_client import GenerationParams, WedlmClient, job_dict
    address, key = sys.argv[1], sys.argv[2]
    params = GenerationParams(mode="ar", max_tokens=8)
    with WedlmClient(address, api_key=key, timeout=120) as client:
        events = list(client.generate_stream(text="hello there", params=params))
        job_id = client.submit(text="hello there", params=params)
        job = job_dict(client.wait_job(job_id, timeout_s=60))
        info = client.model_info()
    heavy = [m for m in ("mlx", "numpy", "transformers", "fastapi") if m in sys.modules]
    print(json.dumps({"kinds": [e[0] for e in events], "final": events[-1][1],
                      "job": job, "layers": info.num_layers, "heavy": heavy}))
    """
)


@pytest.fixture(scope="module")
def client_env(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("client-install")
    src = base / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{src}[client]"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return venv


@pytest.fixture(scope="module")
def coordinator(checkpoint_dir):
    model = checkpoint_dir("wedlm_qwen2", seed=44, num_hidden_layers=2)
    coord, address = start_coordinator(model, cluster_name(), "--no-bonjour", "--api-key", KEY)
    try:
        coord.expect("serving")
        yield address
    finally:
        coord.stop()


def test_client_install_has_no_mlx_and_talks_to_a_cluster(client_env, coordinator):
    python = client_env / "bin" / "python"
    run = subprocess.run(
        [str(python), "-c", CLIENT_SCRIPT, coordinator, KEY],
        capture_output=True, text=True, timeout=300, cwd=client_env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["heavy"] == []
    assert out["kinds"][-1] == "final" and "tokens" in out["kinds"]
    assert out["job"]["state"] == "done"
    assert out["job"]["result"]["tokens"] == out["final"]["tokens"]
    assert out["layers"] == 2


def test_client_cli_commands(client_env, coordinator):
    wedlm = str(client_env / "bin" / "wedlm")
    common = ["--cluster", coordinator, "--api-key", KEY]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([wedlm, *args], capture_output=True, text=True, timeout=300)

    generated = run("generate", *common, "--prompt", "hi", "--mode", "ar", "--max-tokens", "6",
                    "--json")  # fmt: skip
    assert generated.returncode == 0, generated.stderr
    job_id = json.loads(run("submit", *common, "--prompt", "hi", "--mode", "ar",
                            "--max-tokens", "6").stdout)["job_id"]  # fmt: skip
    waited = json.loads(run("wait", job_id, *common, "--timeout", "60").stdout)
    assert waited["result"]["tokens"] == json.loads(generated.stdout)["tokens"]
    assert json.loads(run("job", job_id, *common).stdout)["state"] == "done"
    status = run("status", *common)
    assert status.returncode == 0 and "serving" in status.stdout
    refused = run("status", "--cluster", coordinator)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    local = run("generate", "--model", "default", "--prompt", "hi")
    assert local.returncode == 1 and "wedlm-cluster[server]" in local.stderr
    serve = subprocess.run(
        [str(client_env / "bin" / "wedlm-coordinator"), "serve", "--model", "default"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert serve.returncode == 2 and "wedlm-cluster[server]" in serve.stderr


def test_client_install_runs_wedlm_bench(client_env, coordinator, tmp_path):
    """`wedlm bench serve` over gRPC needs neither MLX nor matplotlib (the PNG is said to be
    missing); `fetch` names the install it needs."""
    wedlm = str(client_env / "bin" / "wedlm")
    env = {**os.environ, "WEDLM_API_KEY": KEY}
    served = subprocess.run(
        [wedlm, "bench", "serve", "--target", coordinator, "--requests", "2", "--warmup", "0",
         "--rounds", "1", "--concurrency", "1", "--max-tokens", "4", "--client-processes", "1",
         "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr[-3000:]
    result = json.loads(served.stdout)
    run = result["levels"]["1"]["rounds"][0]["T1"]
    assert (run["sent"], run["ok"]) == (2, 2)
    assert "matplotlib is not installed" in result["plot"]
    fetch = subprocess.run([wedlm, "bench", "fetch", "--cluster", coordinator],
                           capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert fetch.returncode == 1 and "wedlm-cluster[server,bench]" in fetch.stderr
