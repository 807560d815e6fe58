"""The scheduler's limits, each declared once: its default, its smallest value and its help
are the field's. `wedlm-coordinator serve` makes its flags (server_cli.py) and its TOML keys
(serve_config.py) from the fields that carry a `Knob`; the others are set by the server."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Knob:
    """A setting of the command line (--max-queued) and of the TOML file (max_queued)."""

    help: str
    low: int = 1  # the smallest value accepted (0: zero means something)


def knob(default: int, help: str, low: int = 1) -> Any:
    return field(default=default, metadata={"knob": Knob(help, low)})


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
    return [(f, f.metadata["knob"]) for f in fields(Limits) if "knob" in f.metadata]
