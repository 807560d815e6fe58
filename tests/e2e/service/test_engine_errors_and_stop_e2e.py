"""A coordinator's engine thread survives an error in one request's work (that request
fails with a clear error, a concurrent one completes, the coordinator keeps serving); an
engine that cannot go on ends the process non-zero. SIGTERM and SIGINT stop a coordinator
that is still starting (waiting for workers, warming up), and a worker that is
unassigned, within seconds with exit code 0.
Real processes and gRPC; faults come through the test hook (fault_hooks.py)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from common.generation_params import GenerationParams
from common.model_config import load_model_config
from coordinator.service.fault_hooks import ENGINE_CRASH_FAULT, FAULT_ENV, REQUEST_ERROR_FAULT
from coordinator.service.server_cli import DEATH_LINGER_S
from tests.support.cluster_harness import (
    Proc,
    cluster_name,
    engine_outputs,
    start_coordinator,
    start_fetching_worker,
    start_worker,
    wait_until,
)
from wedlm_client.client import WedlmClient

STOP_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("llama", seed=73, wedlm_record=False, max_position_embeddings=2048)


def _long(model: Path, tokens: int = 400) -> GenerationParams:
    """AR to exactly `tokens` (EOS never chosen): the fault lands while it decodes."""
    eos = load_model_config(model).raw["eos_token_id"]
    return GenerationParams(mode="ar", max_tokens=tokens, logit_bias=((eos, -100.0),))


def _inject(path: Path, fault: str) -> None:
    staged = path.with_suffix(".staged")
    staged.write_text(fault)
    staged.rename(path)  # whole or not at all, for the engine thread polling it


def _serving_with_faults(model: Path, fault: Path) -> tuple[Proc, str]:
    proc, address = start_coordinator(model, cluster_name(), "--no-bonjour",
                                      env={FAULT_ENV: str(fault)})  # fmt: skip
    proc.expect("serving")
    return proc, address


def test_an_error_in_one_request_fails_it_alone(model, tmp_path):
    fault = tmp_path / "fault"
    params = _long(model)
    proc, address = _serving_with_faults(model, fault)
    try:
        with WedlmClient(address, timeout=120) as client:
            victim = client.submit(text="this one breaks", params=params)
            other = client.submit(text="this one goes on", params=params)
            wait_until(
                lambda: all(client.get_job(j).committed_tokens > 0 for j in (victim, other)),
                60,
                "both decoding",
                period=0.02,
            )
            _inject(fault, f"{REQUEST_ERROR_FAULT} {victim}")
            failed = client.wait_job(victim, timeout_s=60)
            done = client.wait_job(other, timeout_s=120)
            after = client.generate(text="and later ones", params=GenerationParams(max_tokens=5))
        assert failed.state == "failed", failed
        assert failed.result.error == (
            f"the coordinator failed this request while delivering its tokens: InjectedFault: "
            f"injected error in request {victim} (it goes on serving other requests)"
        )
        assert failed.committed_tokens < 400
        assert done.state == "done", done
        (expected,) = engine_outputs(model, [("this one goes on", params)])
        assert list(done.result.tokens) == expected
        assert not after.get("error") and after["tokens"]
        log = "".join(proc.log)
        assert f"request {victim} failed while delivering its tokens" in log
        assert "Traceback" in log and "InjectedFault: injected error in request" in log
        assert proc.popen.poll() is None
    finally:
        proc.stop()


def test_an_engine_that_cannot_go_on_ends_the_process_non_zero(model, tmp_path):
    fault = tmp_path / "fault"
    proc, address = _serving_with_faults(model, fault)
    try:
        with WedlmClient(address, timeout=60) as client:
            job = client.submit(text="running when it breaks", params=_long(model, 1500))
            wait_until(lambda: client.get_job(job).committed_tokens > 0, 60, "decoding")
            _inject(fault, ENGINE_CRASH_FAULT)
            assert client.wait_job(job, timeout_s=30).state == "failed"
        broke = time.monotonic()
        code, output = proc.wait_exit(DEATH_LINGER_S + 20)
        assert code == 1, output
        assert time.monotonic() - broke < DEATH_LINGER_S + 15
        assert "EngineBroken: injected engine crash: the engine cannot go on" in output
    finally:
        proc.stop()


def _stops_within(proc: Proc, sig: int, what: str) -> str:
    time.sleep(1.0)  # well inside its wait, not at its first line
    sent = time.monotonic()
    proc.popen.send_signal(sig)
    code, output = proc.wait_exit(30)
    took = time.monotonic() - sent
    assert code == 0, f"{what}: exit {code} after {took:.1f} s: {output}"
    assert took < STOP_WITHIN_S, f"{what} took {took:.1f} s to stop: {output}"
    return output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_coordinator_waiting_for_workers_stops_at_once(model, sig):
    proc, _ = start_coordinator(model, cluster_name(), "--no-bonjour", "--expect", "1")
    try:
        output = _stops_within(proc, sig, "a coordinator waiting for workers")
        assert f"stopping while waiting-for-workers ({signal.Signals(sig).name})" in output
        assert "wedlm-coordinator stopped" in output
    finally:
        proc.stop()


def test_a_coordinator_warming_up_stops_at_once(model):
    """`--warm-up on` on the CPU runs its forwards for half a minute here, on the planner's
    thread: the stop does not wait for them."""
    proc, _ = start_coordinator(model, cluster_name(), "--no-bonjour", "--warm-up", "on")
    try:
        proc.expect("sequences decoded at once")  # the last line before the warm-up
        output = _stops_within(proc, signal.SIGTERM, "a coordinator warming up")
        assert "stopping while warming-up (SIGTERM)" in output, output
        assert not re.search(r"warmed \d+ shapes in", output)  # nor for the warm-up's end
    finally:
        proc.stop()


def test_an_unassigned_worker_stops_at_once(model, tmp_path):
    fetching, _ = start_fetching_worker(cluster_name(), tmp_path / "layers")
    holding, _ = start_worker(model, cluster_name(), "--no-bonjour")
    try:
        _stops_within(fetching, signal.SIGTERM, "an unassigned worker without a model")
        _stops_within(holding, signal.SIGTERM, "an unassigned worker with --model")
    finally:
        fetching.stop()
        holding.stop()
