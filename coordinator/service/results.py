"""The final record of a finished sequence, shared by the CLI and the gRPC service."""

from __future__ import annotations

from typing import Any

from coordinator.engine.sequence import Sequence

OUT_OF_MEMORY = "out_of_memory"  # a forward could not get memory even with this one alone
ENGINE_STOPPED = "engine_stopped"  # the engine thread ended: nothing more is decoded


def result_record(
    seq: Sequence, text: str, error: str = "", error_kind: str = ""
) -> dict[str, Any]:
    """`error_kind`: OUT_OF_MEMORY or ENGINE_STOPPED, which the front ends answer with
    their own statuses (503 / RESOURCE_EXHAUSTED, 503 / UNAVAILABLE); "" for others."""
    forwards = max(seq.forwards, 1)
    record = {
        "tokens": list(seq.output),
        "text": text,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt),
        "forwards": seq.forwards,
        "tokens_per_forward": len(seq.output) / forwards,
        "prefill_s": round(seq.prefill_s, 6),
        "decode_s": round(seq.decode_s, 6),
        "decode_tokens_per_s": len(seq.output) / seq.decode_s if seq.decode_s else None,
        "drafted_tokens": seq.drafted,
        "accepted_drafts": seq.accepted,
        "cached_tokens": seq.cached_tokens,
        "mode": seq.params.mode,
    }
    if seq.warning:
        record["warning"] = seq.warning
    if error:
        record["error"] = error
        if error_kind:
            record["error_kind"] = error_kind
    return record


def error_record(prompt_tokens: int, message: str, error_kind: str = "") -> dict[str, Any]:
    """The record of a request that ended before producing anything."""
    record = {
        "tokens": [],
        "text": "",
        "finish_reason": "error",
        "prompt_tokens": prompt_tokens,
        "forwards": 0,
        "tokens_per_forward": 0.0,
        "prefill_s": 0.0,
        "decode_s": 0.0,
        "decode_tokens_per_s": None,
        "drafted_tokens": 0,
        "accepted_drafts": 0,
        "cached_tokens": 0,
        "error": message,
    }
    if error_kind:
        record["error_kind"] = error_kind
    return record
