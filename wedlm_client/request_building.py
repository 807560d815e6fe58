"""GenerationParams and a prompt → the wire's GenerateRequest (the inverse of the
coordinator's request parsing)."""

from __future__ import annotations

from common.generation_params import GenerationParams
from common.proto_gen import wedlm_pb2 as pb


def request_from_params(
    params: GenerationParams,
    text: str | None = None,
    ids: list[int] | None = None,
    chat: bool = False,
    deadline_s: float = 0.0,
    output_format: pb.OutputFormat | None = None,
) -> pb.GenerateRequest:
    """`output_format`: what the output must match (structured output); None: free text."""
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
        deadline_s=deadline_s,
        draft=params.draft,
        sampler=params.sampler,
        steps=params.steps,
    )
    if params.logprobs is not None:
        req.logprobs = params.logprobs
    if output_format is not None:
        req.output_format.CopyFrom(output_format)
    if params.threshold is None:
        req.one_by_one = True
    else:
        req.threshold = params.threshold
    if ids is not None:
        req.token_ids.ids.extend(ids)
    else:
        req.text = text or ""
    return req
