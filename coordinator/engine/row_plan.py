"""What one sequence contributes to the next forward: its rows, their visibility, how many
of them become permanent KV, and which rows' logits the coordinator needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.engine.sequence import Phase, Sequence


@dataclass
class RowPlan:
    seq: Sequence
    tokens: np.ndarray  # [T] input ids in logical slot order (mask slots hold the mask id)
    filled: np.ndarray  # [T] False for mask slots
    keep: int  # leading rows that become permanent KV after this forward
    head_slots: np.ndarray  # [K] rows whose logits are needed
    head_is_mask: np.ndarray  # [K] which of those may be filled this step
    commits: list[int] = field(default_factory=list)  # tokens committed by this forward
    drafts: int = 0  # speculative mode: draft rows after the `keep` pending ones
    # speculative mode: its own state would draft, but its batch does not this forward
    # (draft_policy.batch_rooms); its draft state is left as it was
    held: bool = False
    canvas: int = 0  # diffusion mode: trailing slots that are a canvas (bidirectional)
    offsets: np.ndarray | None = None  # compacted canvas: each slot's canvas position
    extent: int = 0  # compacted canvas: its length (positions the slots see)
    # the prompt's last chunk carrying the first decode step's mask slots (plan_opening)
    opens: bool = False
    # params.prompt_logprobs: prompt rows whose logits score the next prompt token, which
    # sits at prompt index score_start + j for score slot j (the head runs on them apart)
    score_slots: np.ndarray = field(default_factory=lambda: _NONE)
    score_start: int = 0

    @property
    def width(self) -> int:
        return int(self.tokens.size)

    @property
    def decodes(self) -> bool:
        """Whether this forward runs a decode step of its sequence: a decode row's, or a
        prompt's last chunk opening decoding (plan_opening). Read before postprocess."""
        return self.seq.phase is Phase.DECODE or self.opens


_NONE = np.zeros(0, dtype=np.int64)
