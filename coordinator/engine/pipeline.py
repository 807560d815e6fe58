"""Where the transformer layers run. The engine submits each micro-batch's hidden states
and row spec to a pipeline and later collects the last layer's hidden states, in order.
This one runs the layers in-process; RemotePipeline sends them through the workers."""

from __future__ import annotations

from collections import deque
from typing import Protocol

import mlx.core as mx
import numpy as np

from common.layer_runner import LayerRunner, select_slots
from common.model_parts import ModelParts
from common.rows_spec import RowsSpec


class Pipeline(Protocol):
    def submit(
        self,
        batch_id: int,
        spec: RowsSpec,
        hidden: mx.array,
        reply_slots: np.ndarray | None = None,
    ) -> None:
        """Start running all layers over hidden [rows, T, H]; then keep spec.keeps rows.
        With `reply_slots` ([rows, S]) only those slots' final hidden states come back."""

    def collect(self) -> tuple[int, mx.array]:
        """The oldest submitted micro-batch's id and final hidden states (blocks)."""

    def release(self, seq_ids: list[int], wait: bool = True) -> None:
        """Forget these sequences' KV everywhere. `wait=False` may return before the
        workers have done it: only for ids that no later forward will use again."""


class LocalPipeline:
    def __init__(self, parts: ModelParts) -> None:
        self.runner = LayerRunner(parts)
        self._done: deque[tuple[int, mx.array]] = deque()

    def forward(self, spec: RowsSpec, hidden: mx.array) -> mx.array:
        return self.runner.forward(spec, hidden, validate=False)

    def submit(
        self,
        batch_id: int,
        spec: RowsSpec,
        hidden: mx.array,
        reply_slots: np.ndarray | None = None,
    ) -> None:
        out = self.runner.forward(spec, hidden, validate=False)  # the engine built the spec
        if reply_slots is not None:
            out = select_slots(out, reply_slots)
        mx.async_eval(out)  # the device starts while the host plans the next micro-batch
        self._done.append((batch_id, out))

    def collect(self) -> tuple[int, mx.array]:
        return self._done.popleft()

    def release(self, seq_ids: list[int], wait: bool = True) -> None:
        self.runner.release(seq_ids)
