"""A start never goes quiet: what it is doing, said again every few seconds while a step
that can take long (loading, waiting for workers, a prompt's prefill) runs."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

PROGRESS_EVERY_S = 5.0  # the terminal hears from a start at least this often


@contextlib.contextmanager
def still_working(
    say: Callable[[str], None], what: str, every_s: float = PROGRESS_EVERY_S
) -> Iterator[None]:
    """say(`what` (N s)) every `every_s` seconds until the block ends."""
    done, started = threading.Event(), time.monotonic()

    def remind() -> None:
        while not done.wait(every_s):
            say(f"{what} ({time.monotonic() - started:.0f} s)")

    thread = threading.Thread(target=remind, name="progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
