"""The first minute, as a newcomer has it (issue 54): the README's main command answers
soon on a warm cache and its terminal never goes quiet for 10 s; a start measures before
readiness only what mode auto needs (and only for a WeDLM checkpoint), leaves the draft
break-even to the idle engine and keeps it for the next start; on MLX's CPU backend,
where a wide forward costs many one-row forwards, mode auto decodes a WeDLM checkpoint
with AR and says why, while an explicit `mode: wedlm` still runs WeDLM."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time

import mlx.core as mx
import openai
import pytest

from tests.conftest import shared_model
from tests.e2e.cluster.test_local_cluster_e2e import _command, offline
from tests.support.cluster_harness import (
    cluster_name,
    http_coordinator,
    start_coordinator,
    start_worker,
)

MAIN_COMMAND_S = 40.0  # the bound for the README's main command on a warm cache
QUIET_S = 10.0  # the longest the terminal may stay silent
COST_FILE = "measured-step-costs.json"
on_cpu = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="about MLX's CPU backend")


def _timed_output(argv: list[str], timeout: float) -> tuple[int, list[tuple[float, str]]]:
    """Run argv with stdout and stderr on one pipe; each chunk it wrote with when (s)."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    chunks: list[tuple[float, str]] = []
    try:
        while chunk := os.read(proc.stdout.fileno(), 4096):
            chunks.append((time.monotonic() - started, chunk.decode(errors="replace")))
            assert time.monotonic() - started < timeout, "".join(c for _, c in chunks)
        return proc.wait(30), chunks
    finally:
        if proc.poll() is None:
            proc.kill()


@offline
def test_the_readme_main_command_answers_soon_and_never_goes_quiet():
    from common.default_model import default_model_path

    default_model_path()  # a warm cache: the model converted once, before the timing
    argv = [*_command(), "local", "--model", "default", "--workers", "2", "--chat",
            "--prompt", "What is the capital of France?"]  # fmt: skip
    code, chunks = _timed_output(argv, timeout=300)
    text = "".join(c for _, c in chunks)
    assert code == 0, text[-3000:]
    assert "Paris" in text, text[-3000:]
    times = [0.0] + [t for t, _ in chunks]
    quiet = max(b - a for a, b in itertools.pairwise(times))
    assert quiet <= QUIET_S, f"{quiet:.1f} s without a line:\n{text}"
    assert times[-1] <= MAIN_COMMAND_S, f"answered after {times[-1]:.1f} s:\n{text}"
    # nothing before readiness measures what only speculative requests need
    ready = text.index("local cluster ")
    assert "draft break-even (a drafting forward" not in text[:ready], text


def test_a_pipeline_measures_the_break_even_when_idle_and_the_next_start_reuses_it(
    checkpoint_dir, tmp_path
):
    """A coordinator and a worker (2 micro-batches: no forward's own time is seen online):
    the first start serves before it measures, then measures while idle and keeps the
    figures; the second start on the same model, machine and pipeline measures nothing."""
    model = checkpoint_dir("wedlm_qwen3", seed=31)
    env = {"WEDLM_CACHE_DIR": str(tmp_path)}
    name = cluster_name()
    worker, waddr = start_worker(model, name, "--no-bonjour")
    try:
        for start in ("first", "second"):
            coord, _ = start_coordinator(
                model, name, "--no-bonjour", "--worker", waddr, "--expect", "1",
                "--max-running", "4", env=env,
            )  # fmt: skip
            try:
                if start == "first":
                    coord.expect("measured in the background once the server is idle")
                    coord.expect("serving")
                    coord.expect(r"draft break-even \(.*by rows\): (.*), measured in")
                    kept = json.loads((tmp_path / COST_FILE).read_text())
                    assert len(kept) == 1, kept
                else:
                    coord.expect("reusing what this machine measured for this model")
                    coord.expect("serving")
                    time.sleep(5)  # idle past the background measurement's delay
                    assert not any("draft break-even" in line for line in coord.log)
            finally:
                coord.stop()
    finally:
        worker.stop()


@on_cpu
def test_mode_auto_decodes_a_wedlm_checkpoint_with_ar_where_wide_forwards_cost_much(tmp_path):
    """The shipped WeDLM checkpoint (6-bit) on MLX's CPU backend: a 10-row forward costs
    many one-row forwards there, so mode auto is AR, said once in the log and in
    /v1/models; a request that names mode wedlm still decodes with WeDLM."""
    model = shared_model("wedlm-smollm2-135m-r2")
    env = {"WEDLM_CACHE_DIR": str(tmp_path)}
    with http_coordinator(model, env=env) as coord:
        said = [line for line in coord.proc.log if "mode auto decodes with AR" in line]
        assert len(said) == 1 and "mode wedlm still gets WeDLM" in said[0], coord.proc.log
        with openai.OpenAI(base_url=coord.http, api_key="none", max_retries=0) as client:
            listed = client.models.list().data[0]
            assert listed.model_extra["default_mode"] == "ar"
            auto = client.completions.create(model=listed.id, prompt="1 2 3 4", max_tokens=4)
            assert auto.usage.model_extra["mode"] == "ar"
            wedlm = client.completions.create(
                model=listed.id, prompt="1 2 3 4", max_tokens=4, extra_body={"mode": "wedlm"}
            )
            assert wedlm.usage.model_extra["mode"] == "wedlm"
    kept = json.loads((tmp_path / COST_FILE).read_text())
    (entry,) = kept.values()
    assert float(entry["ratios"]["1"]) > 6.0, entry


def test_mode_auto_keeps_wedlm_where_a_wide_forward_is_cheap(checkpoint_dir, tmp_path):
    """A tiny float WeDLM checkpoint: a 10-row forward costs about a one-row one (the
    weights are small), so mode auto stays WeDLM and nothing is said about it."""
    model = checkpoint_dir("wedlm_qwen3", seed=32)
    env = {"WEDLM_CACHE_DIR": str(tmp_path)}
    with http_coordinator(model, env=env) as coord:
        kept = json.loads((tmp_path / COST_FILE).read_text())
        (entry,) = kept.values()
        assert float(entry["ratios"]["1"]) < 6.0, entry
        assert not any("mode auto decodes with AR" in line for line in coord.proc.log)
        with openai.OpenAI(base_url=coord.http, api_key="none", max_retries=0) as client:
            assert client.models.list().data[0].model_extra["default_mode"] == "wedlm"
