"""The HTTP API's server: uvicorn on its own thread and asyncio loop, beside the gRPC
server and the engine thread. The socket is bound here, so that a taken port fails at
start with a clear message and port 0 picks a free one."""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn

from common.errors import WedlmError
from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.openai_app import build_app

log = logging.getLogger(__name__)


class HttpServer:
    def __init__(self, backend: ApiBackend, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as e:
            self.socket.close()
            raise WedlmError(f"cannot serve HTTP on {host}:{port}: {e.strerror or e}") from None
        self.socket.listen(2048)
        self.host = host
        self.port = self.socket.getsockname()[1]
        self.app = build_app(backend)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        except Exception:  # never silently: the gRPC side keeps serving
            log.exception("the HTTP API stopped")

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 6.0) -> None:
        self.app.state.closing = True  # endless streams (the console's events) end now
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.socket.close()
