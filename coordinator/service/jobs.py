"""Jobs: one per accepted request, whether it came through Generate (streamed) or Submit
(polled). The engine thread publishes commits; gRPC threads read or wait on them."""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from common.generation_params import GenerationParams
from coordinator.service.job_store import (
    JobStore,
    decode_request,
    decode_result,
    encode_request,
)
from coordinator.service.messages import Final, JobEvent, RequestResult, Tokens

log = logging.getLogger(__name__)
TERMINAL = ("done", "cancelled", "failed")


@dataclass
class Job:
    job_id: str
    prompt: list[int]
    params: GenerationParams
    created_at: float = field(default_factory=time.time)
    state: str = "queued"
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob per token, when asked
    result: RequestResult | None = None
    seq_id: int | None = None
    deadline: float | None = None  # wall-clock time after which the job is cancelled
    restored: bool = False  # read from the store: accepted before this process started
    on_finish: Callable[[Job], None] | None = field(default=None, repr=False)
    _listeners: list[Callable[[JobEvent], None]] = field(default_factory=list, repr=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def listen(self) -> queue.Queue:
        """A queue receiving Tokens events and finally a Final (messages.py); a Tokens'
        logprobs: one TokenLogprob per id, or None when the request asked for none."""
        q: queue.Queue = queue.Queue()
        self.listen_with(q.put)
        return q

    def listen_with(self, put: Callable[[JobEvent], None]) -> None:
        """Call `put` with each event, from the engine thread (it must not block): what
        was committed so far at once, then each commit, then the final result. An asyncio
        front end passes a put that hands the event to its own loop."""
        with self._cond:
            if self.tokens:
                put(Tokens(list(self.tokens), None, 1, list(self.logprobs) or None))
            if self.result is not None:
                put(Final(self.result))
            else:
                self._listeners.append(put)

    def mark_running(self) -> None:
        with self._cond:
            if self.state == "queued":
                self.state = "running"

    def publish(self, ids: list[int], text: str, logprobs: list | None = None) -> None:
        with self._cond:
            self.state = "running"
            self.tokens.extend(ids)
            self.logprobs.extend(logprobs or ())
            for put in self._listeners:
                put(Tokens(ids, text, 1, logprobs))

    def finish(self, state: str, result: RequestResult) -> None:
        with self._cond:
            if self.finished:
                return
            self.state = state
            self.result = result
            for put in self._listeners:
                try:
                    put(Final(result))
                except Exception as e:  # one gone client must not keep the others waiting
                    log.warning("job %s: a listener refused its final result: %r", self.job_id, e)
            self._listeners.clear()
            self._cond.notify_all()
        if self.on_finish is not None:
            self.on_finish(self)

    def wait(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.finished, timeout=timeout)


class JobRegistry:
    def __init__(self, keep_finished: int = 10_000, store: JobStore | None = None) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._keep = keep_finished
        self.store = store

    def _persist(self, job: Job) -> None:
        if self.store is not None:
            self.store.accepted(
                job.job_id, job.created_at, encode_request(job.prompt, job.params, job.deadline)
            )
            job.on_finish = self._record

    def _record(self, job: Job) -> None:
        self.store.finished(job.job_id, job.state, job.result)

    def restore(self) -> list[Job]:
        """This model's jobs from the store: finished ones become retrievable again,
        unfinished ones are returned to be run (from the start: a restart lost their
        progress, not the job). A row that cannot be read fails, with the reason, instead
        of being lost; other models' jobs stay in the store for their coordinators."""
        if self.store is None:
            return []
        pending = []
        for row in self.store.load():
            job = self._restored(row)
            if not job.finished:
                pending.append(job)
            with self._lock:
                self._jobs[job.job_id] = job
        self._log_others()
        return pending

    def _restored(self, row: dict) -> Job:
        job_id, created_at = row["job_id"], row["created_at"]
        try:
            prompt, params, deadline = decode_request(row["request"])
            result = decode_result(row["result"]) if row["result"] is not None else None
        except Exception as e:  # whatever is wrong with the row, this job cannot run
            job = Job(job_id, [], GenerationParams(), created_at=created_at, restored=True)
            job.on_finish = self._record
            message = (
                f"job {job_id} was kept in the job store ({self.store.path}) but cannot be "
                f"read back ({type(e).__name__}: {e}); it was not run"
            )
            log.error("%s", message)
            job.finish("failed", RequestResult(finish_reason="error", error=message))
            return job
        job = Job(job_id, prompt, params, created_at=created_at, restored=True)
        job.deadline = deadline
        if result is not None:
            job.state, job.result, job.tokens = row["state"], result, list(result.tokens)
        else:
            job.on_finish = self._record
        return job

    def _log_others(self) -> None:
        others = self.store.others()
        if others:
            log.info(
                "job store: %d unfinished jobs of other models are kept for their "
                "coordinators (not run here): %s",
                sum(o.jobs for o in others),
                ", ".join(f"{o.jobs} of {o.name or 'an unnamed model'} (model {o.identity})"
                          for o in others),
            )  # fmt: skip

    def create(self, prompt: list[int], params: GenerationParams, deadline_s: float = 0.0) -> Job:
        job = Job(uuid.uuid4().hex, prompt, params)
        if deadline_s > 0:
            job.deadline = job.created_at + deadline_s
        self._persist(job)
        with self._lock:
            self._jobs[job.job_id] = job
            self._trim()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def unfinished(self) -> list[Job]:
        with self._lock:
            return [j for j in self._jobs.values() if not j.finished]

    def load(self) -> tuple[int, int]:
        """Unfinished jobs, and the prompt tokens of those not yet running."""
        with self._lock:
            active = [j for j in self._jobs.values() if not j.finished]
        return len(active), sum(len(j.prompt) for j in active if j.state == "queued")

    def _trim(self) -> None:
        done = [j for j in self._jobs.values() if j.finished]
        excess = len(done) - self._keep
        # usually one job over the limit: pick the oldest without sorting them all
        old = heapq.nsmallest(excess, done, key=lambda j: j.created_at) if excess > 0 else []
        for j in old:
            del self._jobs[j.job_id]
        if old and self.store is not None:
            self.store.forget([j.job_id for j in old])
