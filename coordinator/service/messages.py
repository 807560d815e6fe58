"""The messages that cross the engine thread, as frozen dataclasses that consumers `match`
on: the inbox (front ends -> engine thread) and a job's events (engine thread -> the
front end that listens). Plain fields only, so a process boundary can carry them too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


# ---- the inbox of the engine thread (engine_loop.EngineLoop) ---------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    """Start decoding this accepted job."""

    job: Any  # a jobs.Job (jobs.py imports this module, not the other way round)


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop this job; `reason` becomes its finish reason ("cancelled", "shutdown")."""

    job: Any  # a jobs.Job
    reason: str = "cancelled"


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do but look at the loop's flags (a re-plan was asked)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """End the engine thread after the tick in progress."""


Inbox = Submit | Cancel | Wake | Stop


# ---- a job's events (Job.listen_with) ----------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tokens:
    """Committed tokens and their text (None: not decoded, e.g. a replay of what was
    committed before a listener came); `commits`: how many commits were merged into it."""

    ids: list[int]
    text: str | None
    commits: int = 1
    logprobs: list | None = None  # one TokenLogprob per id; None: the request asked none


@dataclass(frozen=True, slots=True)
class Final:
    """The job ended: its result record (results.py)."""

    result: dict[str, Any]


JobEvent = Tokens | Final


def merged(first: Tokens, more: list[Tokens]) -> Tokens:
    """Several waiting commits as one event (one chunk to send, not many); its text is
    a string."""
    ids = list(first.ids)
    text = [first.text or ""]
    logprobs = list(first.logprobs) if first.logprobs is not None else None
    for event in more:
        ids += event.ids
        text.append(event.text or "")
        if logprobs is not None:
            logprobs += event.logprobs or ()
    return Tokens(ids, "".join(text), len(text), logprobs)
