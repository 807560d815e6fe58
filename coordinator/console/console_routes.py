"""The console's routes on the HTTP API's app: the page at `/` and its static files
(no key needed: the page asks for it), and the data it shows, behind the API key:
`/console/state` (one snapshot) and `/console/events` (server-sent events, a snapshot
a second). The page reads the events with fetch(), which can send the Bearer header
(EventSource cannot)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from coordinator.console.console_state import ConsoleState
from coordinator.http_api.api_backend import ApiBackend

STATIC = Path(__file__).parent / "static"
PERIOD_S = 1.0
NO_CACHE = {"Cache-Control": "no-cache"}


def add_console(app: FastAPI, backend: ApiBackend, authorized: Callable[..., Any]) -> None:
    state = ConsoleState(backend)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=NO_CACHE)

    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")

    @app.get("/console/state", dependencies=[Depends(authorized)])
    async def snapshot() -> JSONResponse:
        return JSONResponse(await run_in_threadpool(state.snapshot), headers=NO_CACHE)

    @app.get("/console/events", dependencies=[Depends(authorized)])
    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[str]:
            while not await request.is_disconnected():
                if getattr(request.app.state, "closing", False):  # the server stops
                    return
                body = json.dumps(await run_in_threadpool(state.snapshot), separators=(",", ":"))
                yield f"event: snapshot\ndata: {body}\n\n"
                await asyncio.sleep(PERIOD_S)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={**NO_CACHE, "X-Accel-Buffering": "no"},
        )
