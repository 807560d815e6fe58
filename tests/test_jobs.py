"""The job registry: finished jobs are kept up to a limit (oldest forgotten first, in
memory and in the store), unfinished jobs never."""

from __future__ import annotations

from coordinator.generation_params import GenerationParams
from coordinator.job_store import JobStore
from coordinator.jobs import JobRegistry


def test_registry_keeps_at_most_keep_finished_jobs(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    registry = JobRegistry(keep_finished=3, store=store)
    running = registry.create([1, 2], GenerationParams())
    finished = []
    for i in range(6):
        job = registry.create([3, i], GenerationParams())
        job.finish("done", {"tokens": [i]})
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
    assert all(restored.get(j).result == {"tokens": [i + 3]} for i, j in enumerate(kept))
