"""The scheduler's limits, each declared once: its default, its smallest value and its help
are the field's (a `Knob`, coordinator/knobs.py). `wedlm-coordinator serve` makes its flags
and its TOML keys from the fields that carry one; the others are set by the server."""

from __future__ import annotations

from dataclasses import Field, dataclass

from coordinator.knobs import Knob, knob
from coordinator.knobs import knobs as knobs_of


@dataclass
class Limits:
    max_running: int = 16  # set by the server (--max-running, or sized to memory)
    max_queued: int = knob(
        256, "requests waiting beyond --max-running; more get RESOURCE_EXHAUSTED"
    )
    max_queued_tokens: int = knob(1 << 20, "prompt tokens waiting; more get RESOURCE_EXHAUSTED")
    prefill_chunk: int = 512  # prompt tokens of one sequence per forward
    prefill_budget: int = 1024  # padded prompt rows per prefill micro-batch
    kv_tokens: int | None = None  # KV tokens the workers' free memory holds (None: unknown)
    # KV tokens' worth of memory a sequence's recurrent state takes whatever its length
    # (hybrid families: linear-attention or Mamba layers); set by the server
    state_tokens: int = 0
    prefill_hold: int = knob(
        4,
        "decode steps a new prompt may wait, while others decode, for more prompts to share "
        "its prefill forward (0: prefill each arrival at once)",
        low=0,
    )
    prefill_batch: int = knob(
        8, "new prompts that start a prefill forward without waiting (see --prefill-hold)"
    )


def knobs() -> list[tuple[Field, Knob]]:
    """The fields of Limits that are settings, with their Knob."""
    return knobs_of(Limits)
