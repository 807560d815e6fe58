"""Run one prompt on a single-process engine and report tokens, text and timings."""

from __future__ import annotations

import argparse
from typing import TextIO

from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine, resolve_model
from coordinator.service.messages import RequestResult
from coordinator.service.results import result_record
from wedlm_client.cli import params_from_args, print_result, stream_of


def run_generate(args: argparse.Namespace) -> int:
    """`wedlm-coordinator generate` (and `wedlm generate --model`): stream the text, then
    print the result as `wedlm generate` prints a cluster's."""
    result = generate_locally(args, params_from_args(args), stream_of(args))
    return print_result(args, result.to_dict())


def generate_locally(
    args: argparse.Namespace, params: GenerationParams, stream: TextIO | None
) -> RequestResult:
    local = open_local_engine(args.model)
    tok = local.tokenizer
    if getattr(args, "draft_model", None):
        from coordinator.engine.draft_model import DraftModel
        from coordinator.engine.engine_for import check_draft_model

        check_draft_model(local.engine.parts)
        local.engine.use_drafter(
            DraftModel.load(resolve_model(args.draft_model), local.engine.config, tok)
        )
    prompt = list(args.prompt_ids) if args.prompt_ids else tok.encode(args.prompt, args.chat)
    seq = local.engine.submit(prompt, params)
    detok = tok.detokenizer()
    for commit in local.engine.stream([seq]):
        segment = detok.add(commit.tokens)
        if stream is not None and segment:
            stream.write(segment)
            stream.flush()
    tail = detok.finish()
    if stream is not None:
        stream.write(tail)
    return result_record(seq, tok.text(seq.output))
