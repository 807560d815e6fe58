"""Stack the row plans of one tick into padded arrays: one row of the KV cache per sequence,
windows padded to a common width, head slots padded to a common count."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from common.modes import Mode
from common.rows_spec import RowsSpec
from coordinator.engine.forward_shapes import padded_width
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sampling import STEP_KEY


@dataclass
class TickBatch:
    plans: list[RowPlan]  # one per row of this forward (padding rows follow them)
    tokens: np.ndarray  # [B, T]
    spec: RowsSpec  # what the layers need: sequences, starts, filled flags, keeps
    head_slots: np.ndarray  # [B, K]
    head_is_mask: np.ndarray  # [B, K]
    # [B, S] prompt rows scored for prompt logprobs (RowPlan.score_slots; S = 0: none)
    score_slots: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))

    @property
    def wants_head(self) -> bool:
        return self.head_slots.shape[1] > 0

    def reply_slots(self) -> np.ndarray | None:
        """[rows incl. padding, K]: the slots whose final hidden states the head needs;
        the last worker returns only these (none for a prefill chunk without logits).
        None (every slot) when prompt rows are scored: they are most of a chunk, and K + S
        slots may be more than the forward's width (a worker refuses that); the engine
        takes wanted_slots() from them."""
        if self.score_slots.shape[1]:
            return None
        slots = np.zeros((self.spec.num_rows, self.head_slots.shape[1]), dtype=np.int32)
        slots[: len(self.plans)] = self.head_slots
        return slots

    def wanted_slots(self) -> np.ndarray:
        """[rows, K + S]: the head slots, then the scored prompt rows."""
        return np.concatenate([self.head_slots, self.score_slots], axis=1)

    def _column(self, get, default, dtype) -> mx.array:
        """One decoding parameter per row as a device array (idle rows get `default`)."""
        rows = [p.seq.params for p in self.plans]
        return mx.array([get(r) if r else default for r in rows], dtype=dtype)

    def selection_offsets(self) -> mx.array | None:
        """Per row, where a speculative row's draft candidates start among its head slots
        (None when no row is speculative: WeDLM distances count from the first slot)."""
        if not self.any_speculative:
            return None
        return mx.array([p.drafts + 2 if _speculative(p) else 0 for p in self.plans], mx.float32)

    def selection_arrays(self) -> dict[str, mx.array]:
        """WeDLM slot selection parameters per row. A speculative row's mask slots are
        selected as draft candidates: distances count from its second mask slot (the
        first one's position is taken by the token the forward commits)."""
        ar = float("inf")  # an AR row fills its single slot: adj < inf always holds
        return {
            "threshold": self._column(
                lambda r: ar if r.mode == Mode.AR else (r.threshold or -float("inf")),
                0.0,
                mx.float32,
            ),
            "penalty": self._column(lambda r: r.penalty, 0.0, mx.float32),
        }

    def sampling_arrays(self) -> dict[str, mx.array]:
        """Sampling parameters per row (only needed when some row samples)."""
        return {
            "temperature": self._column(lambda r: r.temperature, 0.0, mx.float32),
            "top_k": self._column(lambda r: r.top_k, 0, mx.int32),
            "top_p": self._column(lambda r: r.top_p, 1.0, mx.float32),
            "seed": self._column(lambda r: r.seed, 0, mx.uint32),
            # Read when the micro-batch completes, after every earlier step's postprocess.
            # Speculative rows key slot s by the output index it predicts (sampling.py).
            "counter": mx.array(
                [len(p.seq.output) if _speculative(p) else p.seq.forwards for p in self.plans],
                dtype=mx.uint32,
            ),
            "stride": mx.array(
                [STEP_KEY if _speculative(p) else 1 for p in self.plans], dtype=mx.uint32
            ),
        }

    def greedy_slots(self) -> mx.array | None:
        """[rows, K]: slots that take the argmax whatever the temperature (a speculative
        row's mask slots: drafts are point proposals), or None when there are none."""
        if not self.any_speculative:
            return None
        flags = self.head_is_mask & np.array([_speculative(p) for p in self.plans])[:, None]
        return mx.array(flags)

    @property
    def any_sampling(self) -> bool:
        return any(p.head_slots.size and p.seq.params.temperature > 0 for p in self.plans)

    @property
    def any_filter(self) -> bool:
        return any(
            p.seq.params.temperature > 0 and (p.seq.params.top_k or p.seq.params.top_p < 1)
            for p in self.plans
        )

    @property
    def any_selection(self) -> bool:
        """Whether some row needs entropies: a WeDLM window, or speculative mask slots."""
        return any(
            p.head_slots.size
            and (p.seq.params.mode == Mode.WEDLM or (_speculative(p) and p.head_is_mask.any()))
            for p in self.plans
        )

    @property
    def any_speculative(self) -> bool:
        return any(_speculative(p) for p in self.plans)


def _speculative(plan: RowPlan) -> bool:
    """A speculative decode row, or a prompt's last chunk opening one (row_plan.plan_opening:
    its first slot chooses like AR's, as the prompt's last row does, and its mask slots draft
    like a decode row's). Its other prefill rows decide like AR's."""
    return plan.seq.params.mode == Mode.SPECULATIVE and plan.decodes


def build_batch(plans: list[RowPlan], padding_ids: list[int] = ()) -> TickBatch:
    """Rows for `plans`, then padding rows (ids of their own, one filled slot, nothing kept)
    up to the bucketed row count."""
    # WeDLM windows change width (W + p) every step and prompts come in every length:
    # padding the width to a few values keeps the set of shapes small (a new shape costs a
    # new kernel/graph; see forward_shapes). AR rows stay 1 wide.
    width = padded_width(max(p.width for p in plans))
    b = len(plans) + len(padding_ids)
    heads = max(p.head_slots.size for p in plans)
    tokens = np.zeros((b, width), dtype=np.int32)
    filled = np.zeros((b, width), dtype=bool)
    head_slots = np.zeros((len(plans), heads), dtype=np.int64)
    head_is_mask = np.zeros((len(plans), heads), dtype=bool)
    for i, p in enumerate(plans):
        tokens[i, : p.width] = p.tokens
        filled[i, : p.width] = p.filled
        head_slots[i, : p.head_slots.size] = p.head_slots
        head_is_mask[i, : p.head_is_mask.size] = p.head_is_mask
    filled[len(plans) :, 0] = True
    pad = len(padding_ids)
    spec = RowsSpec(
        seq_ids=[p.seq.seq_id for p in plans] + list(padding_ids),
        starts=np.array([p.seq.kv_length for p in plans] + [0] * pad, dtype=np.int64),
        widths=np.array([p.width for p in plans] + [1] * pad, dtype=np.int64),
        filled=filled,
        keeps=np.array([p.keep for p in plans] + [0] * pad, dtype=np.int64),
        forks=[
            (p.seq.seq_id, p.seq.prefix.source, p.seq.prefix.length)
            for p in plans
            if p.seq.prefix is not None and not p.seq.prefix.sent
        ],
        canvas=(
            np.array([p.canvas for p in plans] + [0] * pad, dtype=np.int64)
            if any(p.canvas for p in plans)
            else None
        ),
    )
    if any(p.offsets is not None for p in plans):
        spec.offsets = np.tile(np.arange(width), (b, 1))
        spec.extent = spec.widths.copy()
        for i, p in enumerate(plans):
            if p.offsets is not None:
                spec.offsets[i, : p.width] = p.offsets
                # padding slots write past the canvas, never over a position it reuses
                spec.offsets[i, p.width :] = p.extent + np.arange(width - p.width)
                spec.extent[i] = p.extent
    scored = max(p.score_slots.size for p in plans)
    # padded as widths are (bounded shapes); padding slots score row 0 and are not read
    score_slots = np.zeros((len(plans), padded_width(scored)), dtype=np.int64)
    for i, p in enumerate(plans):
        score_slots[i, : p.score_slots.size] = p.score_slots
    return TickBatch(plans, tokens, spec, head_slots, head_is_mask, score_slots)
