"""The result of a finished sequence (messages.RequestResult), shared by the CLI and the
gRPC service."""

from __future__ import annotations

from coordinator.engine.sequence import Sequence
from coordinator.service.messages import RequestResult

OUT_OF_MEMORY = "out_of_memory"  # a forward could not get memory even with this one alone
ENGINE_STOPPED = "engine_stopped"  # the engine thread ended: nothing more is decoded


def result_record(seq: Sequence, text: str, error: str = "", error_kind: str = "") -> RequestResult:
    """`error_kind`: OUT_OF_MEMORY or ENGINE_STOPPED, which the front ends answer with
    their own statuses (503 / RESOURCE_EXHAUSTED, 503 / UNAVAILABLE); "" for others."""
    forwards = max(seq.forwards, 1)
    return RequestResult(
        tokens=tuple(seq.output),
        text=text,
        finish_reason=seq.finish_reason,
        prompt_tokens=len(seq.prompt),
        forwards=seq.forwards,
        tokens_per_forward=len(seq.output) / forwards,
        prefill_s=round(seq.prefill_s, 6),
        decode_s=round(seq.decode_s, 6),
        decode_tokens_per_s=len(seq.output) / seq.decode_s if seq.decode_s else None,
        drafted_tokens=seq.drafted,
        accepted_drafts=seq.accepted,
        cached_tokens=seq.cached_tokens,
        mode=seq.params.mode,
        warning=seq.warning,
        error=error,
        error_kind=error_kind if error else "",
    )


def error_record(prompt_tokens: int, message: str, error_kind: str = "") -> RequestResult:
    """The result of a request that ended before producing anything."""
    return RequestResult(
        finish_reason="error", prompt_tokens=prompt_tokens, error=message, error_kind=error_kind
    )
