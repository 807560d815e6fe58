"""The `usage` of an OpenAI answer: tokens, cached prompt tokens, and beyond OpenAI's fields
the decoding mode and forwards; for n choices and lists of prompts, each prompt once."""

from __future__ import annotations

from typing import Any

from coordinator.service.messages import RequestResult


def choice_usage(result: RequestResult) -> dict[str, Any]:
    prompt, completion = result.prompt_tokens, len(result.tokens)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}  # fmt: skip
    # OpenAI's field for prompt tokens served from a cache
    usage["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    if result.mode:  # beyond OpenAI's fields: the decoding that ran, and its caveat
        usage["mode"] = result.mode
    usage["forwards"] = result.forwards  # forwards that committed its tokens
    if result.warning:
        usage["warning"] = result.warning
    drafted = result.drafted_tokens
    if drafted:  # speculative mode: OpenAI's fields for verified predictions
        accepted = result.accepted_drafts
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return usage


def prompt_usage(results: list[RequestResult]) -> dict[str, Any]:
    """Usage of n choices: the prompt once (as OpenAI counts it), the completions' tokens
    and forwards summed."""
    usage = choice_usage(results[0])
    for result in results[1:]:
        more = choice_usage(result)
        usage["completion_tokens"] += more["completion_tokens"]
        usage["total_tokens"] += more["completion_tokens"]
        usage["forwards"] += more["forwards"]
    return usage


def request_usage(results: list[RequestResult], n: int, echo_only: bool) -> dict[str, Any]:
    """Usage of a request's prompts (n choices each, in order): each prompt counted once,
    everything summed; echo only (max_tokens 0) answers no completion tokens."""
    usage = prompt_usage(results[:n])
    for start in range(n, len(results), n):
        more = prompt_usage(results[start : start + n])
        for key in ("prompt_tokens", "completion_tokens", "total_tokens", "forwards"):
            usage[key] += more[key]
        usage["prompt_tokens_details"]["cached_tokens"] += more["prompt_tokens_details"][
            "cached_tokens"
        ]
        if "completion_tokens_details" in more:
            details = usage.setdefault("completion_tokens_details", {
                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0})  # fmt: skip
            for key, value in more["completion_tokens_details"].items():
                details[key] += value
    if echo_only:
        usage["total_tokens"] -= usage["completion_tokens"]
        usage["completion_tokens"] = 0
    return usage
