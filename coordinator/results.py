"""The final record of a finished sequence, shared by the CLI and the gRPC service."""

from __future__ import annotations

from typing import Any

from coordinator.sequence import Sequence


def result_record(seq: Sequence, text: str, error: str = "") -> dict[str, Any]:
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
    }
    if error:
        record["error"] = error
    return record
