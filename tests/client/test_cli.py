"""`wedlm generate` as a user runs it: real processes, JSON output, streamed text, and
clear errors (non-zero exit, no traceback) for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


def wedlm(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "wedlm_client.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return str(checkpoint_dir("wedlm_qwen3", seed=11))


def test_json_output(model):
    out = wedlm(
        "generate",
        "--model",
        model,
        "--prompt",
        "hello there",
        "--threshold",
        "1.5",
        "--max-tokens",
        "12",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] in ("length", "stop")
    assert len(result["tokens"]) == 12 or result["finish_reason"] == "stop"
    assert result["forwards"] >= 1
    assert result["tokens_per_forward"] == pytest.approx(12 / result["forwards"])
    assert result["prefill_s"] > 0 and result["decode_s"] > 0
    assert isinstance(result["text"], str) and result["text"]


def test_prompt_ids_chat_and_streaming(model):
    ids = wedlm(
        "generate",
        "--model",
        model,
        "--prompt-ids",
        "5,6,7",
        "--mode",
        "ar",
        "--max-tokens",
        "8",
        "--json",
    )
    assert ids.returncode == 0, ids.stderr
    assert json.loads(ids.stdout)["prompt_tokens"] == 3
    streamed = wedlm(
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--chat",
        "--mode",
        "ar",
        "--max-tokens",
        "8",
        "--stop-ids",
        "318",
    )
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--window", "0"], "--window: must be in [1, 64]"),
        (["--threshold", "abc"], "expected a number or 'none'"),
        (["--top-p", "2"], "--top-p: must be in"),
        (["--temperature", "-1"], "--temperature: must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens: must be >= 1"),
        (["--stop-ids", "1,x"], "comma-separated token ids"),
        (["--mode", "beam"], "invalid choice"),
    ],
)
def test_bad_flags(model, args, message):
    out = wedlm("generate", "--model", model, "--prompt", "x", *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_bad_models_and_prompts(model, tmp_path):
    cases = []
    cases.append((["--model", str(tmp_path / "missing")], "does not exist"))
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "config.json").write_text('{"model_type": "bert", "hidden_size": 8}')
    cases.append((["--model", str(broken)], "unsupported model_type 'bert'"))
    cases.append((["--model", model, "--prompt-ids", "1,99999"], "out of range"))
    cases.append((["--model", model, "--prompt-ids", ",".join(["5"] * 600)], "context"))
    for args, message in cases:
        if "--prompt-ids" not in args:
            args = [*args, "--prompt", "x"]
        out = wedlm("generate", *args)
        assert out.returncode == 1, (args, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--http-port", "70000"], "--http-port: port must be in [0, 65535]"),
        (["--http-port", "web"], "--http-port: expected a port number"),
        (["--default-max-tokens", "0"], "--default-max-tokens: must be >= 1"),
        (["--max-request-bytes", "100"], "--max-request-bytes: must be >= 4096"),
    ],
)
def test_coordinator_http_flags(model, args, message):
    out = subprocess.run(
        [sys.executable, "-m", "coordinator.service.server_cli", "serve", "--model", model,
         *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_http_port_taken(model):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        out = subprocess.run(
            [sys.executable, "-m", "coordinator.service.server_cli", "serve", "--model", model,
             "--port", "0", "--http-port", port, "--no-bonjour", "--state-dir", "none"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 1
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
