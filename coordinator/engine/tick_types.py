"""The plain types a tick passes around: the unit a micro-batch belongs to (the prefill
turn or a decode group), a sequence's newly committed tokens, and a full waiting queue."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import WedlmError
from coordinator.engine.sequence import Sequence


@dataclass(frozen=True)
class Prefill:
    """The unit of prefill micro-batches (prompt chunks of any sequences); decode groups
    are the units 0..P-1."""

    def __repr__(self) -> str:
        return "PREFILL"


PREFILL = Prefill()
Unit = Prefill | int  # what a micro-batch belongs to: the prefill turn or a decode group


class QueueFull(WedlmError):
    """The waiting queue is at its limit (requests or prompt tokens)."""


@dataclass
class Commit:
    seq: Sequence
    tokens: list[int]  # newly committed (may be empty when only finishing)
    logprobs: list | None = None  # TokenLogprob per token, when the request asks
