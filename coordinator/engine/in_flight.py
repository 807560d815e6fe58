"""A micro-batch between its launch and its read-back (InFlight), and its results on the
host once read back (Ran), for the engine's postprocess."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.engine import token_logprobs
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.scheduler import Unit
from coordinator.engine.tick_batch import TickBatch


@dataclass
class InFlight:
    batch_id: int
    unit: Unit
    plans: list[RowPlan]
    batch: TickBatch | None  # None until the engine names an unresolved forward's plans
    started: float
    # A look-ahead forward (modes/*.py launch_ahead) launched before its rows were known
    # to the host: its plans are named by the engine's _resolve_ahead, and the pipeline
    # returns every slot's hidden state (the head slots are taken once they are known).
    unresolved: bool = False
    # A look-ahead forward whose inputs went stale (_drop_ahead): read back and discarded.
    dropped: bool = False
    # a speculative look-ahead forward (modes/speculative.py): its rows' width and the
    # most drafts each row carries
    width: int = 0
    caps: list[int] | None = None


@dataclass
class Ran:
    """A completed micro-batch's results on the host, for postprocess."""

    flight: InFlight
    fills: object  # [B, K] bool (a diffusion engine: its per-row CanvasResults)
    tokens: object  # [B, K] int (a diffusion engine: None)
    ahead: bool  # its unit's next forward was launched ahead
    logprobs: token_logprobs.SlotLogprobs | None = None  # for the rows that ask
    prompt_scores: token_logprobs.PromptScores | None = None  # params.prompt_logprobs rows
