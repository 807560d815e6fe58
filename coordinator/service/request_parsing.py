"""GenerateRequest (wire) → prompt ids and GenerationParams, with INVALID_ARGUMENT-worthy
messages for anything out of range."""

from __future__ import annotations

from common.errors import InvalidRequest
from common.generation_params import GenerationParams
from common.modes import Mode
from common.prompt_limit import check_tokens
from common.proto_gen import wedlm_pb2 as pb
from common.tokenizer import Tokenizer

DEFAULTS = GenerationParams()


def params_from_request(req: pb.GenerateRequest) -> GenerationParams:
    if req.one_by_one and req.HasField("threshold"):
        raise InvalidRequest("threshold and one_by_one are exclusive")
    threshold = (
        None
        if req.one_by_one
        else (req.threshold if req.HasField("threshold") else DEFAULTS.threshold)
    )
    return GenerationParams(
        mode=req.mode or Mode.AUTO,  # the served model's own decoding
        window=req.window if req.HasField("window") else DEFAULTS.window,
        threshold=threshold,
        penalty=req.penalty if req.HasField("penalty") else DEFAULTS.penalty,
        temperature=req.temperature,
        top_p=req.top_p if req.HasField("top_p") else DEFAULTS.top_p,
        top_k=req.top_k,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else DEFAULTS.max_tokens,
        stop_ids=tuple(req.stop_ids),
        stop_strings=tuple(req.stop),
        seed=req.seed,
        draft=req.draft or DEFAULTS.draft,
        sampler=req.sampler or DEFAULTS.sampler,
        steps=req.steps if req.HasField("steps") else DEFAULTS.steps,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
    )


def prompt_from_request(req: pb.GenerateRequest, tokenizer: Tokenizer, context: int) -> list[int]:
    """A prompt that cannot fit `context` (the model's positions) raises PromptTooLong
    before it is copied or tokenized whole."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("the request has no prompt (set text or token_ids)")
    if which == "token_ids":
        if req.chat:
            raise InvalidRequest("chat applies to text prompts only")
        check_tokens(len(req.token_ids.ids), context, "token ids")
        return list(req.token_ids.ids)
    if not req.text:
        raise InvalidRequest("the prompt text is empty")
    return tokenizer.encode(req.text, chat=req.chat, limit=context)
