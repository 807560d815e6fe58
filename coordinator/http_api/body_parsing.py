"""A request body → its pydantic model, on a worker thread. FastAPI parses and validates a
declared body on the event loop, where a body near the size limit can take half a second
(40,000 one-word chat messages in 1.4 MB) during which no other request is served. Errors
are raised as FastAPI's own RequestValidationError, with the locations FastAPI gives them,
so they keep the API's error shape. A few bodies are parsed at once (the GIL allows no
more to run anyway), which bounds the memory their parsed objects take together."""

from __future__ import annotations

import asyncio
import json
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

Body = TypeVar("Body", bound=BaseModel)
PARSING_AT_ONCE = 2


async def parse_body(request: Request, model: type[Body], slots: asyncio.Semaphore) -> Body:
    """`slots`: one app's semaphore of PARSING_AT_ONCE."""
    raw = await request.body()  # bounded by LimitBody
    async with slots:
        return await run_in_threadpool(_parse, raw, model)


def _parse(raw: bytes, model: type[Body]) -> Body:
    if not raw.strip():
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, deep nesting
        why = e.msg if isinstance(e, json.JSONDecodeError) else str(e) or type(e).__name__
        error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                 "input": {}, "ctx": {"error": why}}  # fmt: skip
        raise RequestValidationError([error]) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        errors = [{**err, "loc": ("body", *err["loc"])} for err in errors]
        raise RequestValidationError(errors) from None
