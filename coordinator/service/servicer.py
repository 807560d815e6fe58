"""The client-facing gRPC service. It translates and validates, then hands work to the
engine thread; no decoding happens here."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc

from common.errors import CheckpointError, InvalidRequest
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.tokenizer import Tokenizer
from coordinator.engine.engine import Engine
from coordinator.service.admission import (
    INVALID,
    OVERLOADED,
    TOO_LARGE,
    UNAVAILABLE,
    Admission,
    Refused,
)
from coordinator.service.jobs import Job
from coordinator.service.messages import Final, RequestResult, Tokens, merged
from coordinator.service.output_format import grammar_from_request
from coordinator.service.request_parsing import params_from_request, prompt_from_request
from coordinator.service.results import ENGINE_STOPPED, OUT_OF_MEMORY

MAX_WAIT_S = 3600.0


def logprob_messages(logprobs: list | None) -> list[pb.TokenLogprob]:
    """TokenLogprobs (coordinator/engine/token_logprobs.py) as wire messages."""
    return [
        pb.TokenLogprob(
            id=e.token,
            logprob=e.logprob,
            top=[pb.TopLogprob(id=t, logprob=v) for t, v in e.top],
        )
        for e in logprobs or ()
    ]


def final_message(result: RequestResult, logprobs: list | None = None) -> pb.Final:
    stats = pb.GenerationStats(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=len(result.tokens),
        forwards=result.forwards,
        tokens_per_forward=result.tokens_per_forward,
        prefill_s=result.prefill_s,
        decode_s=result.decode_s,
        drafted_tokens=result.drafted_tokens,
        accepted_drafts=result.accepted_drafts,
        cached_tokens=result.cached_tokens,
        mode=result.mode,
        warning=result.warning,
    )
    return pb.Final(
        finish_reason=result.finish_reason or "",
        tokens=result.tokens,
        text=result.text,
        stats=stats,
        error=result.error,
        error_kind=result.error_kind,
        logprobs=logprob_messages(logprobs),
    )


def job_message(job: Job) -> pb.Job:
    msg = pb.Job(
        job_id=job.job_id,
        state=job.state,
        committed_tokens=len(job.tokens),
        created_at=job.created_at,
    )
    if job.result is not None:
        msg.result.CopyFrom(final_message(job.result, job.logprobs))
    return msg


_STATUS = {
    INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# A stream whose job failed for one of these ends with the status, not a Final
_FAILED_STATUS = {
    OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ENGINE_STOPPED: grpc.StatusCode.UNAVAILABLE,
}


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        admission: Admission,
        cluster_status: Callable[[], pb.ClusterStatusReply],
        model_name: str,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.admission = admission
        self.jobs = admission.jobs
        self.cluster_status = cluster_status
        self.model_name = model_name

    # ---- helpers ---------------------------------------------------------------------
    def _accept(self, request: pb.GenerateRequest, context, listen=None) -> Job:
        try:
            self.admission.ready_loop()
            try:
                params = params_from_request(request)
                grammar = grammar_from_request(request, self.engine.grammars)
                params = replace(params, grammar=grammar) if grammar else params
                positions = self.engine.config.max_position_embeddings
                prompt = prompt_from_request(request, self.tokenizer, positions)
            except (InvalidRequest, CheckpointError) as e:
                raise Refused(INVALID, str(e)) from None
            return self.admission.accept(prompt, params, request.deadline_s, listen)
        except Refused as e:
            context.abort(_STATUS[e.kind], str(e))

    def _job(self, job_id: str, context) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        return job

    # ---- RPCs ----------------------------------------------------------------------
    def Generate(self, request, context) -> Iterator[pb.GenerateEvent]:
        events: queue.Queue = queue.Queue()
        job = self._accept(request, context, events.put)
        context.add_callback(lambda: self.admission.cancel(job))
        while True:
            try:
                item = events.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            final = None
            match item:
                case Tokens():
                    # Under load several commits wait here: send them as one chunk (one
                    # message, one wake-up of this thread per client instead of one per
                    # commit); a Final waiting behind them is sent right after.
                    more = []
                    while final is None:
                        try:
                            nxt = events.get_nowait()
                        except queue.Empty:
                            break
                        if isinstance(nxt, Tokens):
                            more.append(nxt)
                        else:
                            final = nxt
                    chunk = merged(item, more)
                    text = chunk.text or ""
                    tokens = pb.TokenChunk(
                        ids=chunk.ids, text=text, logprobs=logprob_messages(chunk.logprobs)
                    )
                    yield pb.GenerateEvent(tokens=tokens)
                case Final():
                    final = item
            if final is not None:
                status = _FAILED_STATUS.get(final.result.error_kind)
                if status is not None:
                    context.abort(status, final.result.error)
                yield pb.GenerateEvent(final=final_message(final.result, job.logprobs))
                return

    def Submit(self, request, context) -> pb.JobRef:
        return pb.JobRef(job_id=self._accept(request, context).job_id)

    def GetJob(self, request, context) -> pb.Job:
        return job_message(self._job(request.job_id, context))

    def WaitJob(self, request, context) -> pb.Job:
        job = self._job(request.job_id, context)
        if request.timeout_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be >= 0")
        limit = request.timeout_s or MAX_WAIT_S
        remaining = context.time_remaining()
        if remaining is not None:
            limit = min(limit, max(remaining - 0.05, 0.0))
        deadline = time.monotonic() + limit
        while not job.finished and time.monotonic() < deadline and context.is_active():
            job.wait(min(1.0, max(deadline - time.monotonic(), 0.0)))
        return job_message(job)

    def CancelJob(self, request, context) -> pb.Job:
        job = self._job(request.job_id, context)
        if not job.finished:
            self.admission.cancel(job)
            job.wait(5.0)
        return job_message(job)

    def ClusterStatus(self, request, context) -> pb.ClusterStatusReply:
        return self.cluster_status()

    def ModelInfo(self, request, context) -> pb.ModelInfoReply:
        cfg = self.engine.config
        return pb.ModelInfoReply(
            model_name=self.model_name,
            model_type=cfg.model_type,
            model_identity=cfg.identity,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            mask_token_id=cfg.mask_token_id,
            eos_token_ids=list(self.engine.model_stop_ids),
            has_chat_template=self.tokenizer.has_chat_template,
            default_mode=self.engine.default_mode,
        )
