"""The jobs the engine thread is decoding, by sequence id: each started on the engine, its
commits published to its job as text, and ended (done, cancelled, failed) with its final
record and metrics, whatever fails on the way: its client must hear."""

from __future__ import annotations

import logging
import time

from common.errors import InvalidRequest
from common.modes import Mode
from common.tokenizer import TextStream, Tokenizer
from coordinator.engine.engine import Engine
from coordinator.engine.scheduler import QueueFull
from coordinator.engine.sequence import Phase, Sequence
from coordinator.service.fault_hooks import InjectedFault
from coordinator.service.jobs import Job
from coordinator.service.messages import RequestResult
from coordinator.service.metrics import Metrics
from coordinator.service.results import error_record, result_record

log = logging.getLogger(__name__)


class LiveJob:
    """A job being decoded: its sequence, text stream and latency bookkeeping."""

    def __init__(self, job: Job, seq: Sequence, stream: TextStream) -> None:
        self.job, self.seq, self.stream = job, seq, stream
        self.started: float | None = None  # admitted to running
        self.last_token: float | None = None


class LiveJobs:
    """The jobs being decoded (only the engine thread reads or changes them)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.by_seq: dict[int, LiveJob] = {}
        self.request_fault: str | None = None  # a job id whose next delivery fails (tests)

    def fail_request(self, live: LiveJob, error: Exception, doing: str) -> None:
        """One request's own work raised: that request fails, the others go on."""
        log.error("request %s failed while %s: %s", live.job.job_id, doing, error,
                  exc_info=error)  # fmt: skip
        self.engine.cancel(live.seq, "error")
        self.finish(
            live.seq,
            "failed",
            f"the coordinator failed this request while {doing}: {type(error).__name__}: "
            f"{error} (it goes on serving other requests)",
        )

    def start(self, job: Job, leader: Sequence | None = None) -> Sequence | None:
        """Hand `job` to the engine (`leader`: the choice whose prompt rows it copies)."""
        if job.finished:
            return None
        try:
            seq = self.engine.submit(job.prompt, job.params, leader)
        except QueueFull as e:  # a backstop: the servicer checks the limits first
            job.finish("failed", error_record(len(job.prompt), str(e)))
            return None
        except InvalidRequest as e:  # the servicer checks new requests: a stored job
            job.finish("failed", error_record(len(job.prompt), self._cannot_run(job, e)))
            return None
        except Exception as e:  # a bug in this request's setup: it alone fails
            log.error("job %s could not start: %s", job.job_id, e, exc_info=e)
            message = f"the coordinator could not start this request: {type(e).__name__}: {e}"
            job.finish("failed", error_record(len(job.prompt), message))
            return None
        job.seq_id = seq.seq_id
        self.by_seq[seq.seq_id] = LiveJob(job, seq, self.tokenizer.detokenizer())
        return seq

    def _cannot_run(self, job: Job, error: InvalidRequest) -> str:
        if not job.restored:
            return str(error)
        message = (
            f"job {job.job_id} was accepted before this coordinator started and cannot run "
            f"on its model (identity {self.engine.config.identity}): {error}"
        )
        log.error("%s", message)
        return message

    def expire(self) -> None:
        now = time.time()
        for live in list(self.by_seq.values()):
            deadline = live.job.deadline
            if deadline is not None and now > deadline:
                self.end(live, "cancelled", reason="deadline")

    def end(self, live: LiveJob, state: str, reason: str = "cancelled") -> None:
        self.engine.cancel(live.seq, reason)
        self.finish(live.seq, state)

    def deliver(self, commits) -> None:
        now = time.monotonic()
        finished = {}  # a sequence may commit twice in one tick: it ends after the last
        for commit in commits:
            live = self.by_seq.get(commit.seq.seq_id)
            if live is None:
                continue
            try:
                self._deliver_one(live, commit, now)
            except Exception as e:  # this request's text or listeners: it alone fails
                finished.pop(commit.seq.seq_id, None)
                self.fail_request(live, e, "delivering its tokens")
                continue
            if commit.seq.finished:
                finished[commit.seq.seq_id] = commit.seq
        for seq in finished.values():
            self.finish(seq, "done")
        self._mark_started(now)

    def _deliver_one(self, live: LiveJob, commit, now: float) -> None:
        if self.request_fault is not None and live.job.job_id == self.request_fault:
            self.request_fault = None
            raise InjectedFault(f"injected error in request {live.job.job_id}")
        if commit.tokens:
            self._observe_tokens(live, len(commit.tokens), now)
            text = live.stream.add(commit.tokens)
            live.job.publish(commit.tokens, text, commit.logprobs)

    def _mark_started(self, now: float) -> None:
        for live in self.by_seq.values():
            if live.started is None and live.seq.phase is not Phase.WAITING:
                live.started = now
                live.job.mark_running()
                self.metrics.queue_time.observe(time.time() - live.job.created_at)

    def _observe_tokens(self, live: LiveJob, count: int, now: float) -> None:
        m = self.metrics
        m.generation_tokens.inc(count)
        if live.last_token is None:
            m.ttft.observe(time.time() - live.job.created_at)
        else:  # tokens committed together share the gap since the previous commit
            gap = (now - live.last_token) / count
            for _ in range(count):
                m.itl.observe(gap)
        live.last_token = now

    def finish(self, seq: Sequence, state: str, error: str = "", error_kind: str = "") -> None:
        """End the request's job, whatever fails on the way: its client must hear."""
        live = self.by_seq.pop(seq.seq_id, None)
        if live is None:
            return
        try:
            record = self._final_record(live, seq, state, error, error_kind)
        except Exception as e:  # its text or metrics: the job still ends, with why
            log.error("request %s: its result could not be made: %s", live.job.job_id, e,
                      exc_info=e)  # fmt: skip
            why = f"the coordinator could not make this request's result: {type(e).__name__}: {e}"
            state, record = "failed", error_record(len(seq.prompt), error or why, error_kind)
        live.job.finish(state, record)

    def _final_record(
        self, live: LiveJob, seq: Sequence, state: str, error: str, error_kind: str
    ) -> RequestResult:
        tail = live.stream.finish()  # text the streaming detokenizer held back
        if tail:
            live.job.publish([], tail)
        record = result_record(seq, self.tokenizer.text(seq.output), error, error_kind)
        m = self.metrics
        m.prompt_tokens.inc(seq.prefilled)
        m.prompt_tokens_computed.inc(max(seq.prefilled - seq.cached_tokens, 0))
        m.prompt_tokens_shared.inc(seq.shared_tokens)
        m.decode_forwards.inc(seq.forwards)
        m.requests.labels(seq.finish_reason or state).inc()
        m.e2e.observe(time.time() - live.job.created_at)
        if seq.forwards:
            m.tokens_per_forward.observe(len(seq.output) / seq.forwards)
        if seq.params.mode == Mode.SPECULATIVE:
            m.drafted_tokens.inc(seq.drafted)
            m.accepted_drafts.inc(seq.accepted)
            if seq.forwards:
                m.accepted_per_forward.observe(seq.accepted / seq.forwards)
        if seq.params.mode == Mode.DIFFUSION and seq.canvases:
            m.diffusion_canvases.inc(seq.canvases)
            m.steps_per_canvas.observe(seq.forwards / seq.canvases)
        if len(seq.output) > 1 and seq.decode_s:
            m.tpot.observe(seq.decode_s / (len(seq.output) - 1))
        return record
