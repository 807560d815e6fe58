"""GenerateRequest (wire) → prompt ids and GenerationParams, with INVALID_ARGUMENT-worthy
messages for anything out of range."""

from __future__ import annotations

from common.errors import InvalidRequest
from common.proto_gen import wedlm_pb2 as pb
from common.tokenizer import Tokenizer
from coordinator.engine.generation_params import GenerationParams

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
        mode=req.mode or DEFAULTS.mode,
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
    )


def prompt_from_request(req: pb.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("the request has no prompt (set text or token_ids)")
    if which == "token_ids":
        if req.chat:
            raise InvalidRequest("chat applies to text prompts only")
        return list(req.token_ids.ids)
    if not req.text:
        raise InvalidRequest("the prompt text is empty")
    return tokenizer.encode(req.text, chat=req.chat)


def request_from_params(
    params: GenerationParams,
    text: str | None = None,
    ids: list[int] | None = None,
    chat: bool = False,
) -> pb.GenerateRequest:
    """The inverse, for clients."""
    req = pb.GenerateRequest(
        chat=chat,
        mode=params.mode,
        window=params.window,
        penalty=params.penalty,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_ids=list(params.stop_ids),
        stop=list(params.stop_strings),
        seed=params.seed,
    )
    if params.threshold is None:
        req.one_by_one = True
    else:
        req.threshold = params.threshold
    if ids is not None:
        req.token_ids.ids.extend(ids)
    else:
        req.text = text or ""
    return req
