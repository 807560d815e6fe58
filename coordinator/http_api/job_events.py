"""A job's events, handed from the engine thread to the HTTP server's asyncio loop
without a thread per request: the engine thread calls `put` (never blocking), the
request's coroutine awaits `next`, which also notices a client that went away."""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.requests import Request

from coordinator.service.messages import JobEvent, Tokens, merged

DISCONNECT_POLL_S = 0.5


class JobEvents:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: deque[JobEvent] = deque()
        self._arrived = asyncio.Event()

    def put(self, event: JobEvent) -> None:
        """Job.listen_with's sink, called on the engine thread."""
        self._loop.call_soon_threadsafe(self._push, event)

    def _push(self, event: JobEvent) -> None:
        self._events.append(event)
        self._arrived.set()

    async def next(self, request: Request, merge: bool = True) -> JobEvent | None:
        """The next event, with the commits already waiting merged into one Tokens
        (its `commits` says how many) so that a busy tick sends one chunk, not many
        (merge=False: one commit, one forward's tokens, per event; its logprobs: the
        TokenLogprob of each id, or None when the request asked for none); None when the
        client disconnected."""
        while not self._events:  # under load commits usually wait already: no timer then
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
        event = self._events.popleft()
        more = []
        while merge and isinstance(event, Tokens) and self._events:
            if not isinstance(self._events[0], Tokens):
                break  # the Final waits its turn
            more.append(self._events.popleft())
        return merged(event, more) if isinstance(event, Tokens) else event
