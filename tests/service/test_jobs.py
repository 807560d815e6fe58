"""The job registry: finished jobs are kept up to a limit (oldest forgotten first, in
memory and in the store), unfinished jobs never; an accepted job is on disk before its id
is handed out."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

import pytest

from common.generation_params import GenerationParams
from coordinator.service.job_store import JobStore, JobStoreError
from coordinator.service.jobs import JobRegistry
from coordinator.service.messages import RequestResult


def test_registry_keeps_at_most_keep_finished_jobs(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    registry = JobRegistry(keep_finished=3, store=store)
    running = registry.create([1, 2], GenerationParams())
    finished = []
    for i in range(6):
        job = registry.create([3, i], GenerationParams())
        job.finish("done", RequestResult(tokens=(i,)))
        finished.append(job.job_id)
    registry.create([4], GenerationParams())  # creating trims the finished ones beyond 3
    assert registry.get(running.job_id) is not None  # unfinished: never forgotten
    kept = [j for j in finished if registry.get(j) is not None]
    assert kept == finished[-3:]  # the newest three survive
    store.close()
    restored = JobRegistry(keep_finished=3, store=JobStore(tmp_path / "jobs.sqlite"))
    pending = restored.restore()
    assert {j.job_id for j in pending} >= {running.job_id}
    assert all(restored.get(j) is None for j in finished[:3])  # forgotten in the store too
    assert all(restored.get(j).result == RequestResult(tokens=(i + 3,)) for i, j in enumerate(kept))


def test_an_accepted_job_is_committed_before_create_returns(tmp_path):
    """A coordinator killed right after answering Submit must find the job again: another
    connection sees the row as soon as create() returns, for every one of many jobs."""
    store = JobStore(tmp_path / "jobs.sqlite")
    registry = JobRegistry(store=store)
    reader = sqlite3.connect(tmp_path / "jobs.sqlite")
    try:
        for i in range(20):
            job = registry.create([5, i], GenerationParams())
            row = reader.execute(
                "SELECT state FROM jobs WHERE job_id = ?", (job.job_id,)
            ).fetchone()
            assert row == ("queued",), f"job {i} was not committed when create() returned"
    finally:
        reader.close()
        store.close()


def test_a_job_the_store_cannot_write_is_not_accepted(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    registry = JobRegistry(store=store)
    with sqlite3.connect(tmp_path / "jobs.sqlite") as db:
        db.execute("DROP TABLE jobs")  # every later write fails
    with pytest.raises(JobStoreError, match="cannot write: no such table: jobs"):
        registry.create([6], GenerationParams())
    assert registry.unfinished() == []  # nothing half-accepted stays behind
    store.close()


def test_a_result_is_stored_as_the_json_record_older_versions_wrote_and_read(tmp_path):
    """The store keeps the record's JSON keys (a result is read back whole), and reads a
    record of an older version, which lacked cached_tokens and mode."""
    result = RequestResult(tokens=(5, 6), text="hi", finish_reason="stop", prompt_tokens=2,
                           forwards=2, tokens_per_forward=1.0, mode="ar")  # fmt: skip
    store = JobStore(tmp_path / "jobs.sqlite")
    registry = JobRegistry(store=store)
    job = registry.create([1, 2], GenerationParams())
    job.finish("done", result)
    store.close()
    with sqlite3.connect(tmp_path / "jobs.sqlite") as db:
        (raw,) = db.execute("SELECT result FROM jobs").fetchone()
    assert list(json.loads(raw)) == [
        "tokens", "text", "finish_reason", "prompt_tokens", "forwards", "tokens_per_forward",
        "prefill_s", "decode_s", "decode_tokens_per_s", "drafted_tokens", "accepted_drafts",
        "cached_tokens", "mode",
    ]  # fmt: skip
    restored = JobRegistry(store=JobStore(tmp_path / "jobs.sqlite"))
    restored.restore()
    assert restored.get(job.job_id).result == result
    old = {k: v for k, v in result.to_dict().items() if k not in ("cached_tokens", "mode")}
    assert RequestResult.from_dict({**old, "error": "x"}) == replace(result, mode="", error="x")
