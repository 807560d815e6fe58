"""`wedlm bench agent`, run as a user runs it (a real `wedlm` process) against a real
coordinator's HTTP API: a small session over chat completions and over Anthropic Messages
has a row per turn whose cached tokens rise turn after turn (the prefix cache serves the
previous turns); a turn past the model's context and a closed port end the replay with one
line, the rows before still written."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import TOOL_CHAT_TEMPLATE
from tests.support.cluster_harness import free_port, http_coordinator

pytestmark = pytest.mark.e2e

CONTEXT = 4096
GENERATION_PROMPT = 16  # tokens at most, in the tiny checkpoint's tokenizer
SMALL = ["--system-tokens", "300", "--turns", "3", "--tool-result-tokens", "100", "300",
         "--max-tokens", "4"]  # fmt: skip


def agent(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "wedlm_client.cli", "bench", "agent", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    model = checkpoint_dir("qwen2", seed=7, chat_template=TOOL_CHAT_TEMPLATE,
                           max_position_embeddings=CONTEXT)  # fmt: skip
    with http_coordinator(model) as coordinator:
        yield coordinator


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_session_reads_more_from_cache_turn_after_turn(server, api, tmp_path: Path):
    url = server.http if api == "openai" else server.root
    seed = "1" if api == "openai" else "2"  # a session of its own: its first turn is cold
    out = agent("--url", url, "--api", api, *SMALL, "--seed", seed, "--json",
                "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result == json.loads((tmp_path / "agent.json").read_text()) | {"files": result["files"]}
    assert result["tool"] == "wedlm bench agent" and result["target"]["api"] == api
    assert result["session"]["counted_by"] == f"{server.root}/tokenize"
    assert 250 <= result["session"]["system_and_tools_tokens"] <= 350
    rows = result["turns"]
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert out.stderr.count("[agent ") == 3  # a progress line per turn
    for r in rows:
        assert r["ttft_ms"] > 0 and r["total_s"] > 0 and 1 <= r["completion_tokens"] <= 4
    prompts, cached = [r["prompt_tokens"] for r in rows], [r["cached_tokens"] for r in rows]
    assert prompts[0] >= 300 and prompts[0] < prompts[1] < prompts[2], rows
    # another seed's session shares only the template's and the system prompt's first words
    assert rows[0]["cached_share"] < 0.05 and 0 < cached[1] < cached[2], rows
    for previous, r in itertools.pairwise(rows):
        # the previous prompt but its generation prompt ("<|im_start|>assistant\n"), which
        # this turn's user message replaces (the model's answer is never sent back)
        assert previous["prompt_tokens"] - GENERATION_PROMPT <= r["cached_tokens"], rows
        assert r["reused_share"] >= 0.99 and 0 < r["cached_share"] < 1
    summary = result["summary"]
    assert summary["turns"] == 3 and summary["every_later_turn_reused_95"] is True
    assert summary["ttft_ms_median"] > 0 and summary["first_turn_ttft_ms"] == rows[0]["ttft_ms"]
    assert (tmp_path / "agent.png").stat().st_size > 0


def test_a_turn_past_the_context_ends_the_replay_with_the_rows_before(server, tmp_path):
    out = agent("--url", server.http, "--system-tokens", "300", "--turns", "3",
                "--tool-result-tokens", "1000", "1000", "--max-tokens", "4", "--seed", "3",
                "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 1
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("wedlm: error:")]
    assert line.startswith(f"wedlm: error: turn 3: {server.http} refused: HTTP 400: "), line
    assert "turn 3:" in out.stdout  # the table, then the error
    result = json.loads((tmp_path / "agent.json").read_text())
    assert [r["turn"] for r in result["turns"]] == [1, 2]
    assert result["error"] == line.removeprefix("wedlm: error: ")


def test_a_closed_port_is_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = agent("--url", url, *SMALL, "--out", str(tmp_path))
    assert out.returncode == 1 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"wedlm: error: {url}: does not answer (APIConnectionError: "), line
    assert "Connection refused" in line and line.endswith("(or give --model)"), line
