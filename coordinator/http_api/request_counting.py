"""Prometheus counts of HTTP requests by route and status, as plain ASGI middleware (no
buffering: streamed answers pass through untouched)."""

from __future__ import annotations

import time

from coordinator.service.metrics import Metrics


class CountRequests:
    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"  # bounded label values
            self.metrics.http_requests.labels(scope["method"], path, str(status)).inc()
            self.metrics.http_duration.labels(path).observe(time.perf_counter() - start)
