"""Faults a test injects into a running coordinator, to check that it survives them: off
unless $WEDLM_FAULT_FILE names a file. A test writes one fault's name into that file (whole:
written beside it, then renamed); the engine thread takes it (and removes the file) at its
next tick:
- "out-of-memory": the next forward's result is lost to an out-of-memory error, raised
  where a real one surfaces (the pipeline's collect), with its forwards in flight;
- "engine-crash": the engine thread cannot go on (as when its own state is broken): it
  ends, every open request fails, and the process exits non-zero;
- "request-error JOB_ID": the next delivery of that job's tokens raises, as a bug in one
  request's work would: that request fails, the others go on.
"""

from __future__ import annotations

from pathlib import Path

from common.env_switches import FAULT_FILE

FAULT_ENV = FAULT_FILE.name  # what tests set
OUT_OF_MEMORY_FAULT = "out-of-memory"
ENGINE_CRASH_FAULT = "engine-crash"
REQUEST_ERROR_FAULT = "request-error"


class InjectedFault(RuntimeError):
    """An error a test asked for (its message words it as the real one would be)."""


class FaultFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> FaultFile | None:
        path = FAULT_FILE.read()
        return cls(Path(path)) if path else None

    def take(self) -> str | None:
        """The fault asked for since the last call, if any (each is taken once)."""
        try:
            text = self.path.read_text().strip()
        except (FileNotFoundError, IsADirectoryError):
            return None
        if not text:  # being written (write it elsewhere and rename it here to avoid this)
            return None
        self.path.unlink(missing_ok=True)
        return text


def fail_next_collect(pipeline, error: Exception) -> None:
    """Make the pipeline's next collect read its forward's result and then raise `error`,
    once (the forward ran; its result is lost, as when the device runs out of memory)."""
    inner = pipeline.collect

    def failing():
        del pipeline.collect  # back to the class's method: one failure only
        inner()
        raise error

    pipeline.collect = failing


def parse_fault(text: str | None) -> tuple[str | None, str]:
    """A fault's name and its argument ("" when it takes none): "request-error abc" ->
    ("request-error", "abc")."""
    if text is None:
        return None, ""
    name, _, argument = text.partition(" ")
    return name, argument.strip()
