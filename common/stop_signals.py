"""SIGTERM and SIGINT for a server's main thread (coordinator and worker alike): stop in
any state. While the process is being built (loading a model: plain code that checks
nothing) a signal raises StopRequested there; after, it is only recorded, for the main
loop to read."""

from __future__ import annotations

import signal


class StopRequested(BaseException):
    """SIGTERM or SIGINT while the server is being built (a BaseException, as
    KeyboardInterrupt: no `except Exception` on the way may swallow it)."""


class StopSignals:
    """SIGTERM and SIGINT, recorded. While `raising`, the handler also raises StopRequested.
    Else it only appends (no lock): an Event's set() would take the lock of the Event.wait
    that the signal interrupts on this same thread, and hang for good."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.raising = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        self.received.append(signum)
        if self.raising:
            raise StopRequested(signum)

    def name(self) -> str:
        return signal.Signals(self.received[0]).name if self.received else ""
