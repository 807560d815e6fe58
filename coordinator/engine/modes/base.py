"""What a decoding mode is to the engine: one object per mode (modes/__init__.py registers
them by name) that plans a sequence's rows for its next forward, commits a forward's result,
may launch the next forward ahead of the read-back, and says what it needs of a request.

The engine and the scheduler only ask the mode of a row; they hold no mode checks of their
own. A new mode is a module with a subclass of `DecodingMode` and one `register` call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from common.generation_params import GenerationParams
from common.rows_spec import RowsSpec
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Sequence
from coordinator.engine.step_cost import StepCost
from coordinator.engine.tick_batch import TickBatch


@dataclass
class PlanContext:
    """What planning a row needs to know of the engine: the model's mask id and context,
    the prompt chunk, and a drafting forward's cost in AR forwards (draft_policy.py)."""

    mask_token_id: int
    max_positions: int
    prefill_chunk: int = 512
    break_even: float = 1.0


@dataclass
class AheadForward:
    """A forward a mode builds before the host has read the previous one back: its input
    ids on the device, its RowsSpec, and the plans that stand for it (`batch` set when
    they are its own; None while they are the previous step's stand-ins, named later by
    `DecodingMode.resolve_ahead`)."""

    plans: list[RowPlan]
    spec: RowsSpec
    ids: mx.array
    batch: TickBatch | None = None
    width: int = 0  # a speculative chain: its rows' width
    caps: list[int] | None = None  # a speculative chain: the most drafts each row carries


def ahead_spec(
    plans: list[RowPlan], padding: list[int], width: int, filled: np.ndarray, visibility
) -> RowsSpec:
    """A look-ahead forward's RowsSpec: each row `width` wide from its committed KV on
    (padding rows one slot at 0), nothing kept yet (look_ahead.resolve names the keeps),
    the slots' visibility given on the device."""
    b = len(plans) + len(padding)
    return RowsSpec(
        seq_ids=[p.seq.seq_id for p in plans] + padding,
        starts=np.array([p.seq.kv_length + p.keep for p in plans] + [0] * len(padding)),
        widths=np.array([width] * len(plans) + [1] * len(padding)),
        filled=filled,
        keeps=np.zeros(b, dtype=np.int64),
        visibility=visibility,
    )


class Flight(Protocol):
    """The micro-batch being completed, as a mode sees it (engine.InFlight)."""

    unit: object
    plans: list[RowPlan]
    batch: TickBatch | None
    width: int
    caps: list[int] | None


class AheadRoom(Protocol):
    """What the engine lends a mode to decide and build a look-ahead forward."""

    ctx: PlanContext
    step_cost: StepCost
    keeps_later: bool  # every layer runs in this process (kept rows named later)
    constrained_ahead: bool  # constrained rows may be launched ahead too
    speculative_ahead: bool  # speculative drafting spells may be chained on the device
    cut: set[int]  # sequences whose run the grammar cut at the last step

    def allows(self, mode: str) -> bool: ...  # its look-ahead is not switched off
    def prefill(self, flight: Flight) -> bool: ...
    def chain_breaks(self, flight: Flight, plans: list[RowPlan]) -> bool: ...
    def joiners(self, flight: Flight, plans: list[RowPlan]) -> list[Sequence] | None: ...
    def slot_owed(self, flight: Flight) -> bool: ...
    def padding_ids(self, flight: Flight, rows: int) -> list[int]: ...


class DecodingMode:
    """The default answers are AR's; a mode overrides what it does differently."""

    name: str = ""
    # whether the tokens of its decode forwards feed the drafts' break-even (step_cost):
    # a WeDLM window's forward is neither AR's nor a drafting one
    times_steps: bool = True
    # whether its rows may carry mask slots (a checkpoint that never learned them decodes
    # them badly: engine_requests.mode_warning)
    def uses_masks(self, params: GenerationParams) -> bool:
        return False

    def resolve(self, params: GenerationParams, has_drafter: bool, wedlm_trained: bool):
        """The request's parameters as this mode runs them (e.g. "auto" draft sources)."""
        return params

    def plan(self, seq: Sequence, ctx: PlanContext, room: int | None) -> RowPlan:
        """The rows of `seq`'s next decode forward (`room`: the drafts its batch lets it
        carry, for modes that draft)."""
        raise NotImplementedError

    def opening(
        self, seq: Sequence, chunk_tokens: np.ndarray, ctx: PlanContext
    ) -> RowPlan | None:
        """The prompt's last chunk with the first decode step's slots after it, in one
        forward (None: the chunk runs alone)."""
        return None

    def first_token_from_prompt(self) -> bool:
        """Whether the prompt's last row chooses the first token (AR, speculative)."""
        return True

    def prefilled(self, seq: Sequence, plan: RowPlan) -> bool:
        """The prompt is in the KV after `plan`'s forward: set up decoding; True when this
        forward already commits (its head slots were read)."""
        return True

    def commit(
        self, plan: RowPlan, fills: np.ndarray, tokens: np.ndarray, break_even: float
    ) -> list[int]:
        """The tokens a decode forward (or an opening prompt chunk) commits, before stop
        checks."""
        return [int(tokens[0])]

    def launch_ahead(
        self, room: AheadRoom, flight: Flight, fills: mx.array, tokens: mx.array
    ) -> AheadForward | None:
        """The unit's next forward, built from this step's device results before they are
        read back, or None where it depends on them (the regular launch plans it)."""
        return None

    def resolve_ahead(self, stand_in: RowPlan, flight: Flight, row: int, ctx: PlanContext):
        """A look-ahead forward's own plan for row `row`, once the step before it is
        postprocessed; None: the one a regular launch would make now."""
        return None

    def drafting(self, plan: RowPlan) -> bool:
        """Whether the row verifies drafts (the engine counts such micro-batches)."""
        return False
