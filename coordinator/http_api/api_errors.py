"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with
the status the `openai` package maps to its exception classes."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.service.admission import (
    INVALID,
    OVERLOADED,
    TOO_LARGE,
    UNAVAILABLE,
    Overflow,
    Refused,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
STATUS_OF_REFUSAL = {INVALID: 400, TOO_LARGE: 400, OVERLOADED: 429, UNAVAILABLE: 503}


class ApiError(Exception):
    """`kind`: the error's type when it is not the status's usual one."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str | None = None,
):
    kind = kind or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    body = error_body(err.status, err.message, err.param, err.code, err.kind)
    return JSONResponse(body, err.status)


CONTEXT_EXCEEDED = "context_length_exceeded"


def overflow_message(
    overflow: Overflow, prompt_name: str = "messages", limit_field: str | None = None
) -> str:
    """OpenAI's words for a request that does not fit ("This model's maximum context
    length is N tokens. However, you requested M tokens (P in the messages, C in the
    completion)..."), which clients such as litellm recognise as a context-window error."""
    o = overflow
    where = (" on this cluster now (the KV rows its workers' free memory holds)"
             if o.kv else "")  # fmt: skip
    head = f"This model's maximum context length is {o.limit} tokens{where}. However, "
    if o.completion is None:
        more = f" (and decoding takes {o.rows} more positions)" if o.rows else ""
        return (f"{head}your {prompt_name} resulted in {o.prompt} tokens{more}. Please "
                f"reduce the length of the {prompt_name}.")  # fmt: skip
    window = f", {o.rows} for the decoding window" if o.rows else ""
    asked = o.prompt + o.completion + o.rows
    field = f" ({limit_field})" if limit_field else ""
    return (f"{head}you requested {asked} tokens ({o.prompt} in the {prompt_name}, "
            f"{o.completion} in the completion{window}). Please reduce the length of the "
            f"{prompt_name} or completion{field}.")  # fmt: skip


def prompt_too_long_message(detail: str, limit: int, prompt_name: str = "messages") -> str:
    """A prompt refused before it was tokenized whole: its size is known only roughly."""
    return (f"This model's maximum context length is {limit} tokens. However, {detail}. "
            f"Please reduce the length of the {prompt_name}.")  # fmt: skip


def from_refusal(
    refusal: Refused,
    param: str | None = None,
    fields: tuple[str, ...] = (),
    prompt_name: str = "messages",
) -> ApiError:
    """`param`: the field a TOO_LARGE refusal names; an invalid request whose message
    starts with one of `fields` names that one (e.g. a mode this model does not decode).
    `prompt_name`: the request's prompt field, named by a prompt that does not fit."""
    status = STATUS_OF_REFUSAL[refusal.kind]
    if (overflow := refusal.overflow) is not None:
        field = prompt_name if overflow.completion is None else param
        message = overflow_message(overflow, prompt_name, param)
        return ApiError(400, message, field, CONTEXT_EXCEEDED)
    code = {TOO_LARGE: CONTEXT_EXCEEDED, OVERLOADED: "overloaded"}.get(refusal.kind)
    message = str(refusal)
    if refusal.kind == INVALID:
        param = next((f for f in fields if message.startswith(f + " ")), None)
    elif refusal.kind != TOO_LARGE:
        param = None
    return ApiError(status, message, param, code)


def _field(loc: tuple) -> str:
    """('body', 'messages', 0, 'role') → 'messages[0].role'."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[int]", "list[str]", "list[list[int]]", "list[ContentPart]"):
            continue  # pydantic names the union member it tried; the field is enough
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_problem(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, field) of a body that failed validation, in the words every API uses."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        return message.rstrip(": "), None
    field = _field(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        message = f"{field} is required" if field else "the request body is empty"
    else:
        message = f"{field}: {first.get('msg', 'invalid value')}" if field else first.get("msg")
    return message, field or None


async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    message, field = validation_problem(exc)
    return JSONResponse(error_body(400, message, field), 400)


async def on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc)


async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code)
