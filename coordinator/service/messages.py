"""The messages that cross the engine thread, as frozen dataclasses that consumers `match`
on: the inbox (front ends -> engine thread) and a job's events (engine thread -> the
front end that listens). Plain fields only, so a process boundary can carry them too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


# ---- the inbox of the engine thread (engine_loop.EngineLoop) ---------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    """Start decoding this accepted job, and `choices`: the other choices of the same
    request (n > 1, the same prompt), which copy its prompt rows instead of prefilling
    them (they come in one message, so that the job is still running when they start)."""

    job: Any  # a jobs.Job (jobs.py imports this module, not the other way round)
    choices: tuple = ()  # jobs.Job each


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
class RequestResult:
    """How a request ended: its tokens and text, why it ended and what it cost. Built by
    results.py; `error` is set when it failed (`error_kind`: results.OUT_OF_MEMORY or
    ENGINE_STOPPED, which the front ends answer with their own statuses)."""

    tokens: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "cancelled", "deadline", "error"...
    prompt_tokens: int = 0
    forwards: int = 0  # forwards that committed its tokens
    tokens_per_forward: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float | None = None
    drafted_tokens: int = 0  # speculative mode: drafts verified, and accepted
    accepted_drafts: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    mode: str = ""  # the decoding that ran ("" when it failed before starting)
    warning: str = ""  # why its text may be degraded (Engine.mode_warning)
    error: str = ""
    error_kind: str = ""
    stop_sequence: str | None = None  # the stop string that ended the text (HTTP trims it)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (job store, `wedlm generate`): every field, but the optional
        ones (mode, warning, error, error_kind, stop_sequence) only when set."""
        record = {f: getattr(self, f) for f in _ALWAYS}
        record["tokens"] = list(self.tokens)
        record.update({f: getattr(self, f) for f in _WHEN_SET if getattr(self, f)})
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> RequestResult:
        """A record of `to_dict` (older versions' lack some fields: their defaults)."""
        known = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "tokens": tuple(known.get("tokens", ()))})


_WHEN_SET = ("mode", "warning", "error", "error_kind", "stop_sequence")
_ALWAYS = tuple(f for f in RequestResult.__dataclass_fields__ if f not in _WHEN_SET)


@dataclass(frozen=True, slots=True)
class Final:
    """The job ended: its result (results.py)."""

    result: RequestResult


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
