"""A job's events, handed from the engine thread to the HTTP server's asyncio loop
without a thread per request: the engine thread calls `put` (never blocking), the
request's coroutine awaits `next`, which also notices a client that went away."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

DISCONNECT_POLL_S = 0.5


class JobEvents:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[tuple] = asyncio.Queue()

    def put(self, event: tuple) -> None:
        """Job.listen_with's sink, called on the engine thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next(self, request: Request) -> tuple | None:
        """The next event, with the commits already waiting merged into one
        ("tokens", ids, text) so that a busy tick sends one chunk, not many; None when
        the client disconnected."""
        while True:
            try:
                event = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
                break
            except TimeoutError:
                if await request.is_disconnected():
                    return None
        if event[0] != "tokens":
            return event
        ids, text = list(event[1]), [event[2] or ""]
        while not self._queue.empty():
            if self._queue._queue[0][0] != "tokens":  # leave the final for the next call
                break
            more = self._queue.get_nowait()
            ids += more[1]
            text.append(more[2] or "")
        return ("tokens", ids, "".join(text))
