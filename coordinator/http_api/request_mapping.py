"""An OpenAI request → the prompt's token ids and GenerationParams. Each problem becomes
an ApiError(400) naming the field. Omitted WeDLM fields take the server's defaults; an
omitted temperature means greedy decoding (the server default, as mlx-lm's server does)."""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from typing import Any

from common.errors import CheckpointError, InvalidRequest, PromptTooLong
from common.generation_params import GenerationParams
from common.modes import Mode
from common.prompt_limit import check_tokens
from common.tokenizer import Tokenizer
from coordinator.http_api.api_errors import (
    CONTEXT_EXCEEDED,
    ApiError,
    overflow_message,
    prompt_too_long_message,
)
from coordinator.http_api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationFields,
)
from coordinator.service.admission import Overflow

DEFAULTS = GenerationParams()
MAX_STOP_STRINGS = 16
# The error messages of GenerationParams.validate name their field first.
PARAM_FIELDS = ("mode", "window", "threshold", "penalty", "temperature", "top_p", "top_k",
                 "max_tokens", "seed", "draft", "sampler", "steps", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logit_bias")  # fmt: skip


def _message_text(i: int, message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise ApiError(
                400,
                f"messages[{i}].content[{j}]: parts of type {part.type!r} are not supported "
                "(this model reads text only)",
                f"messages[{i}].content[{j}].type",
            )
        parts.append(part.text)
    return "".join(parts)


def _too_long(e: PromptTooLong, field: str, context: int) -> ApiError:
    return ApiError(400, prompt_too_long_message(str(e), context, field), field, CONTEXT_EXCEEDED)


def _template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    """One OpenAI message as chat templates read it (transformers' convention, as mlx-lm's
    server passes it): a call's arguments as a mapping, a tool result's call id kept."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": _message_text(i, m)}  # fmt: skip
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            arguments = call.function.arguments
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    raise ApiError(
                        400,
                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                        f"messages[{i}].tool_calls[{j}].function.arguments",
                    ) from None
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id or "", "type": "function", "function": function})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role == "tool":
        out["name"] = m.name
    return out


def chat_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template reads them (None: not rendered)."""
    if not body.tools_in_use():
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools or ()]


def chat_prompt(body: ChatCompletionRequest, tokenizer: Tokenizer, context: int) -> list[int]:
    """`context`: the model's positions; a prompt that cannot fit them is refused without
    being tokenized whole."""
    messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
    tools = chat_tools(body)
    if tools and tokenizer.tool_calling is None:
        raise ApiError(
            400,
            "tools: this model's chat template has no tool calling (no tool-call format "
            "mlx-lm knows); send tool_choice 'none' or no tools",
            "tools",
        )
    try:
        return tokenizer.encode_chat(messages, context, tools)
    except PromptTooLong as e:
        raise _too_long(e, "messages", context) from None
    except CheckpointError:
        raise ApiError(
            400,
            "this model has no chat template: use /v1/completions with a plain prompt",
            "messages",
        ) from None
    except Exception as e:  # a template may refuse an order of roles it does not know
        raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from e


def completion_prompt(body: CompletionRequest, tokenizer: Tokenizer, context: int) -> list[int]:
    """The one prompt of a request that takes one (the Ollama and other adapters')."""
    prompts = body.prompts()
    if len(prompts) != 1:
        raise ApiError(400, f"prompt: one prompt per request, got {len(prompts)}", "prompt")
    return completion_prompts(body, tokenizer, context)[0]


def completion_prompts(
    body: CompletionRequest, tokenizer: Tokenizer, context: int, vocab: int = 1 << 31
) -> list[list[int]]:
    """Each prompt's token ids (a list of prompts: one each, in order); `vocab`: token-id
    prompts are checked against it."""
    prompts = body.prompts()
    if not prompts:
        raise ApiError(400, "prompt must not be empty", "prompt")
    out = []
    for i, prompt in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not prompt:
            raise ApiError(400, f"{field} must not be empty", field)
        try:
            if isinstance(prompt, str):
                out.append(tokenizer.encode(prompt, limit=context))
                continue
            check_tokens(len(prompt), context, "token ids")
        except PromptTooLong as e:
            raise _too_long(e, field, context) from None
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"{field}: token ids outside the vocabulary [0, {vocab}): "
                           f"{bad[:5]}", field)  # fmt: skip
        out.append([int(t) for t in prompt])
    return out


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(strings) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} strings", "stop")
    if any(not s for s in strings):
        raise ApiError(400, "stop: stop strings must not be empty", "stop")
    return strings


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": value} as (id, value) pairs, ids within the vocabulary (the
    values' range is GenerationParams' to check)."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            message = f"logit_bias: keys are token ids, got {key!r}"
            raise ApiError(400, message, "logit_bias") from None
        if not 0 <= token < vocab:
            raise ApiError(400, f"logit_bias: token id {token} is outside the vocabulary "
                           f"[0, {vocab})", "logit_bias")  # fmt: skip
        pairs.append((token, float(value)))
    return tuple(pairs)


def generation_params(
    body: GenerationFields,
    prompt_tokens: int,
    context: int,
    default_max_tokens: int,
    vocab: int = 1 << 31,
) -> GenerationParams:
    """`vocab`: the model's vocabulary size (logit_bias ids are checked against it)."""
    problem = body.unsupported()
    if problem is not None:
        field, why = problem
        raise ApiError(400, why if why.startswith(field) else f"{field}: {why}", field)
    try:
        logprobs = body.logprob_count()
    except ValueError as e:
        field = str(e).split(":")[0].split(" ")[0]
        raise ApiError(400, str(e), field) from None
    threshold = DEFAULTS.threshold if body.threshold is None else body.threshold
    if body.one_by_one:
        if body.threshold is not None:
            raise ApiError(400, "threshold and one_by_one are exclusive", "one_by_one")
        threshold = None
    try:
        params = GenerationParams(
            mode=body.mode or Mode.AUTO,  # the served model's own decoding
            window=DEFAULTS.window if body.window is None else body.window,
            threshold=threshold,
            penalty=DEFAULTS.penalty if body.penalty is None else body.penalty,
            temperature=0.0 if body.temperature is None else body.temperature,
            top_p=DEFAULTS.top_p if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            max_tokens=1,  # decided below, once the window is known to be valid
            stop_ids=tuple(body.stop_token_ids or ()),
            stop_strings=_stop_strings(body.stop),
            seed=secrets.randbelow(2**32) if body.seed is None else body.seed % 2**32,
            draft=body.draft or DEFAULTS.draft,
            sampler=body.sampler or DEFAULTS.sampler,
            steps=body.steps or 0,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias, vocab),
        )
    except InvalidRequest as e:
        message = str(e)
        field = next((f for f in PARAM_FIELDS if message.startswith(f)), None)
        if message.startswith("stop ids"):
            field, message = "stop_token_ids", f"stop_token_ids: {message}"
        raise ApiError(400, message, field) from None
    room = context - prompt_tokens - params.forward_rows
    max_tokens = body.limit()
    if room < 1 or (max_tokens is not None and max_tokens > room):
        overflow = Overflow(context, prompt_tokens, max_tokens, params.forward_rows)
        field = body.prompt_field() if max_tokens is None else body.limit_field()
        message = overflow_message(overflow, body.prompt_field(), body.limit_field())
        raise ApiError(400, message, field, CONTEXT_EXCEEDED)
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, room))
    return replace(params, max_tokens=max_tokens)
