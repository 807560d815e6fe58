"""Request bodies bounded at the door, as plain ASGI middleware: a declared Content-Length
over the limit is answered 413 before one byte of the body is read, and a chunked body's
bytes are counted as they arrive, so that nothing larger than the limit is ever buffered
or parsed. The answer has OpenAI's error shape."""

from __future__ import annotations

import contextlib
import json

from coordinator.http_api.api_errors import error_body


class BodyTooLarge(Exception):
    """Raised from `receive` inside the app once a streamed body passes the limit."""


class LimitBody:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            # The HTTP server delivers at most Content-Length bytes: no counting needed.
            if declared > self.max_bytes:
                await self._refuse(send, f"is {declared:,} bytes")
            else:
                await self.app(scope, receive, send)
            return
        received = 0
        refused = started = False

        async def counting_receive():
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if refused:  # the app's own answer to BodyTooLarge (a 400 or 500): ours instead
                return
            started = True
            await send(message)

        with contextlib.suppress(BodyTooLarge):  # FastAPI may turn it into its own error
            await self.app(scope, counting_receive, guarded_send)
        if refused and not started:
            await self._refuse(send, f"(chunked) reached {received:,} bytes")

    async def _refuse(self, send, size: str) -> None:
        message = (
            f"the request body {size}, over this server's limit of {self.max_bytes:,} bytes "
            "(--max-request-bytes)"
        )
        body = json.dumps(error_body(413, message, code="request_too_large")).encode()
        # The rest of the body stays unread, so the connection cannot carry another request.
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope) -> int | None:
    """The declared length, unless a Transfer-Encoding says the body is framed otherwise
    (then its bytes are counted)."""
    headers = dict(scope.get("headers", ()))
    if b"transfer-encoding" in headers:
        return None
    try:
        return int(headers[b"content-length"])
    except (KeyError, ValueError):  # none, or malformed (which the HTTP server refuses)
        return None
