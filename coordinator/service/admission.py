"""Admission of a generation request, shared by the gRPC and HTTP front ends: validate
it, check that it can ever fit and that the queues have room, then create and persist its
job and hand it to the engine thread. Refusals say why, with a kind each front end maps
to its own status (INVALID_ARGUMENT / 400, RESOURCE_EXHAUSTED / 429, UNAVAILABLE / 503)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import CheckpointError, InvalidRequest, PromptTooLong, WedlmError
from common.generation_params import GenerationParams
from coordinator.engine.engine import Engine
from coordinator.service.engine_loop import EngineLoop
from coordinator.service.job_store import JobStoreError
from coordinator.service.jobs import Job, JobRegistry
from coordinator.service.results import error_record

INVALID, TOO_LARGE, OVERLOADED, UNAVAILABLE = "invalid", "too_large", "overloaded", "unavailable"


@dataclass(frozen=True)
class Overflow:
    """A request that cannot fit: `limit` positions (the model's context, or the KV rows
    the workers' memory holds now), `prompt` + `completion` + `rows` (the decoding window)
    asked for. Front ends word it their API's way (OpenAI's context_length_exceeded)."""

    limit: int
    prompt: int
    completion: int | None
    rows: int
    kv: bool = False  # the limit is the workers' free memory, not the model's context


class Refused(WedlmError):
    def __init__(self, kind: str, message: str, overflow: Overflow | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.overflow = overflow


class Admission:
    def __init__(
        self,
        engine: Engine,
        jobs: JobRegistry,
        loop: Callable[[], EngineLoop | None],
        draining: Callable[[], bool],
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        self.loop = loop  # None until the pipeline is planned
        self.draining = draining
        self._lock = threading.Lock()  # checks and creation happen together

    def ready_loop(self) -> EngineLoop:
        loop = self.loop()
        if self.draining():
            raise Refused(UNAVAILABLE, "the coordinator is shutting down")
        if loop is None:
            raise Refused(UNAVAILABLE, "the cluster is not ready (no workers yet)")
        if loop.dead is not None:
            raise Refused(UNAVAILABLE, f"the coordinator's engine stopped ({loop.dead})")
        return loop

    def accept(
        self,
        prompt: list[int],
        params: GenerationParams,
        deadline_s: float = 0.0,
        listen: Callable[[tuple], None] | None = None,
    ) -> Job:
        """Create the job and start it; `listen` (see Job.listen_with) is attached before
        the engine sees the job, so that no commit reaches it without its text."""
        return self.accept_choices(prompt, [params], deadline_s, [listen])[0]

    def accept_choices(
        self,
        prompt: list[int],
        choices: list[GenerationParams],
        deadline_s: float = 0.0,
        listens: list[Callable[[tuple], None] | None] | None = None,
    ) -> list[Job]:
        """The n choices of one request (n > 1: the same prompt, their own seeds), accepted
        or refused together, each a job with its `listens` entry attached, started in one
        message: the choices after the first copy its prompt rows (prompt_sharing.py)."""
        loop = self.ready_loop()
        choices = [self.engine.resolve_mode(p) for p in choices]
        for params in choices:
            self._validate(prompt, params, deadline_s)
        with self._lock:
            self._check_room(len(prompt), len(choices))
            jobs: list[Job] = []
            try:
                for params in choices:
                    jobs.append(self.jobs.create(prompt, params, deadline_s))
            except JobStoreError as e:  # not written: not accepted
                for job in jobs:
                    job.finish("failed", error_record(len(prompt), str(e)))
                raise Refused(UNAVAILABLE, str(e)) from None
        for job, listen in zip(jobs, listens or [None] * len(jobs), strict=True):
            if listen is not None:
                job.listen_with(listen)
        loop.submit(jobs[0], tuple(jobs[1:]))
        return jobs

    def _validate(self, prompt: list[int], params: GenerationParams, deadline_s: float) -> None:
        """Refuse a request that is malformed or can never fit."""
        try:
            self.engine.validate_prompt(prompt, params)
            if deadline_s < 0 or deadline_s != deadline_s:
                raise InvalidRequest(f"deadline_s must be >= 0, got {deadline_s}")
        except PromptTooLong as e:
            limit = self.engine.config.max_position_embeddings
            overflow = Overflow(limit, len(prompt), None, params.forward_rows)
            raise Refused(INVALID, str(e), overflow) from None
        except (InvalidRequest, CheckpointError) as e:
            raise Refused(INVALID, str(e)) from None
        budget = self.engine.limits.kv_tokens
        need = len(prompt) + params.max_tokens + params.forward_rows
        if budget is not None and need > budget:
            raise Refused(
                TOO_LARGE,
                f"the request may need {need} KV rows; the workers' free memory holds "
                f"{budget} (lower max_tokens or add workers)",
                Overflow(budget, len(prompt), params.max_tokens, params.forward_rows, kv=True),
            )

    def _check_room(self, prompt_tokens: int, count: int = 1) -> None:
        """Refuse at once, rather than queue without bound (`count` jobs of this prompt)."""
        limits = self.engine.limits
        active, tokens = self.jobs.load()
        if active + count > limits.max_running + limits.max_queued:
            raise Refused(
                OVERLOADED,
                f"overloaded: {active} requests accepted ({limits.max_running} run at once, "
                f"{limits.max_queued} may wait); retry later",
            )
        if tokens + count * prompt_tokens > limits.max_queued_tokens:
            raise Refused(
                OVERLOADED,
                f"overloaded: {tokens} prompt tokens queued (limit {limits.max_queued_tokens})",
            )

    def cancel(self, job: Job) -> None:
        loop = self.loop()
        if not job.finished and loop is not None:
            loop.cancel(job)
