"""One job store shared by coordinators of several models (same host, --state-dir and
cluster): each reads and resumes only its own model's jobs, the others' stay untouched; a
store of an older version (no model column) is migrated; a row that cannot be read fails
with the reason instead of being lost."""

from __future__ import annotations

import logging
import sqlite3

from common.generation_params import GenerationParams
from coordinator.service.job_store import JobStore, OtherModel, encode_request
from coordinator.service.jobs import JobRegistry
from coordinator.service.messages import RequestResult

OLD_SCHEMA = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    state TEXT NOT NULL,
    request BLOB NOT NULL,
    result TEXT
)
"""


def test_each_model_restores_only_its_own_jobs(tmp_path, caplog):
    path = tmp_path / "jobs-c.sqlite"
    a = JobRegistry(store=JobStore(path, "id-a", "model-a"))
    queued = a.create([1, 2], GenerationParams(max_tokens=5))
    done = a.create([3], GenerationParams())
    done.finish("done", RequestResult(tokens=(7,)))
    a.store.close()

    b = JobRegistry(store=JobStore(path, "id-b", "model-b"))
    with caplog.at_level(logging.INFO, logger="coordinator.service.jobs"):
        assert b.restore() == []
    assert b.get(queued.job_id) is None and b.get(done.job_id) is None
    assert b.store.others() == [OtherModel("id-a", "model-a", 1)]
    lines = [r.getMessage() for r in caplog.records if "other models" in r.getMessage()]
    assert lines == [
        "job store: 1 unfinished jobs of other models are kept for their coordinators "
        "(not run here): 1 of model-a (model id-a)"
    ]
    mine = b.create([4], GenerationParams())  # b's own job, beside a's
    b.store.close()

    again = JobRegistry(store=JobStore(path, "id-a", "model-a"))
    pending = again.restore()
    assert [j.job_id for j in pending] == [queued.job_id]
    assert pending[0].prompt == [1, 2] and pending[0].params.max_tokens == 5
    assert pending[0].restored
    assert again.get(done.job_id).result == RequestResult(tokens=(7,))
    assert again.get(mine.job_id) is None
    assert again.store.others() == [OtherModel("id-b", "model-b", 1)]
    again.store.close()


def test_an_older_store_is_migrated_and_its_jobs_taken_by_the_first_model(tmp_path):
    path = tmp_path / "jobs-c.sqlite"
    with sqlite3.connect(path) as db:
        db.execute(OLD_SCHEMA)
        db.execute(
            "INSERT INTO jobs VALUES ('old', 1.0, 'queued', ?, NULL)",
            (encode_request([5, 6], GenerationParams(max_tokens=3), None),),
        )
    store = JobStore(path, "id-a", "model-a")
    assert store.adopted == 1
    registry = JobRegistry(store=store)
    (job,) = registry.restore()
    assert job.job_id == "old" and job.prompt == [5, 6]
    registry.create([7], GenerationParams())  # the migrated table takes new jobs
    store.close()
    later = JobStore(path, "id-b", "model-b")  # nothing left unnamed: nothing taken
    assert later.adopted == 0 and later.load() == []
    assert later.others() == [OtherModel("id-a", "model-a", 2)]
    later.close()


def test_a_row_that_cannot_be_read_fails_with_the_reason(tmp_path):
    path = tmp_path / "jobs-c.sqlite"
    store = JobStore(path, "id-a", "model-a")
    store.accepted("broken", 1.0, b"\xc1 not msgpack")
    store.close()
    registry = JobRegistry(store=JobStore(path, "id-a", "model-a"))
    assert registry.restore() == []
    job = registry.get("broken")
    assert job.state == "failed" and job.finished
    assert "job broken was kept in the job store" in job.result.error
    assert "cannot be read back" in job.result.error and "it was not run" in job.result.error
    registry.store.close()
    with sqlite3.connect(path) as db:  # the failure is recorded, not lost
        state, result = db.execute("SELECT state, result FROM jobs").fetchone()
    assert state == "failed" and "cannot be read back" in result
