"""A job's events, handed from the engine thread to the HTTP server's asyncio loop
without a thread per request: the engine thread calls `put` (never blocking), the
request's coroutine awaits `next`, which also notices a client that went away."""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.requests import Request

DISCONNECT_POLL_S = 0.5


class JobEvents:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: deque[tuple] = deque()
        self._arrived = asyncio.Event()

    def put(self, event: tuple) -> None:
        """Job.listen_with's sink, called on the engine thread."""
        self._loop.call_soon_threadsafe(self._push, event)

    def _push(self, event: tuple) -> None:
        self._events.append(event)
        self._arrived.set()

    async def next(self, request: Request, merge: bool = True) -> tuple | None:
        """The next event, with the commits already waiting merged into one
        ("tokens", ids, text, commits, logprobs) so that a busy tick sends one chunk, not
        many (merge=False: one commit, one forward's tokens, per event; logprobs: the
        TokenLogprob of each id, empty when the request asked for none); None when the
        client disconnected."""
        while not self._events:  # under load commits usually wait already: no timer then
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
        event = self._events.popleft()
        if event[0] != "tokens":
            return event
        ids, text = list(event[1]), [event[2] or ""]
        logprobs = list(event[3] or ())
        while merge and self._events and self._events[0][0] == "tokens":  # final waits its turn
            more = self._events.popleft()
            ids += more[1]
            text.append(more[2] or "")
            logprobs += more[3] or ()
        return ("tokens", ids, "".join(text), len(text), logprobs)
