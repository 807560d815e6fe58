"""Run one prompt on a single-process engine and report tokens, text and timings."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from coordinator.generation_params import GenerationParams
from coordinator.local_engine import open_local_engine


def generate_locally(
    args: argparse.Namespace, params: GenerationParams, stream: TextIO | None
) -> dict[str, Any]:
    local = open_local_engine(args.model)
    tok = local.tokenizer
    prompt = list(args.prompt_ids) if args.prompt_ids else tok.encode(args.prompt, args.chat)
    params = _with_tokenizer_stops(params, tok.stop_ids)
    seq = local.engine.submit(prompt, params)
    detok = tok.detokenizer()
    for commit in local.engine.stream([seq]):
        for t in commit.tokens:
            detok.add_token(t)
        segment = detok.last_segment  # reading it consumes it
        if stream is not None and segment:
            stream.write(segment)
            stream.flush()
    detok.finalize()
    if stream is not None:
        stream.write(detok.last_segment)
    return result_record(seq, tok.decode(seq.output), len(prompt))


def _with_tokenizer_stops(params: GenerationParams, stops: tuple[int, ...]) -> GenerationParams:
    from dataclasses import replace

    return replace(params, stop_ids=tuple(dict.fromkeys(params.stop_ids + stops)))


def result_record(seq, text: str, prompt_tokens: int) -> dict[str, Any]:
    forwards = max(seq.forwards, 1)
    return {
        "tokens": list(seq.output),
        "text": text,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": prompt_tokens,
        "forwards": seq.forwards,
        "tokens_per_forward": len(seq.output) / forwards,
        "prefill_s": round(seq.prefill_s, 6),
        "decode_s": round(seq.decode_s, 6),
        "decode_tokens_per_s": len(seq.output) / seq.decode_s if seq.decode_s else None,
    }
