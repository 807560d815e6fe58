"""Where the transformer layers run. A pipeline is a list of stages: the coordinator's own
layer range, run in-process by the engine thread right after the embedding, then the
workers' chain (the workers relay to each other; the last answers). Either part may be
absent: a coordinator alone holds every layer, one started with --no-local-layers holds
none. The engine submits each micro-batch's hidden states and row spec and later collects
the last layer's hidden states, in order."""

from __future__ import annotations

from collections import deque
from typing import Protocol

import mlx.core as mx
import numpy as np

from common.kv_format import FULL, KVFormat
from common.layer_runner import LayerRunner
from common.model_parts import ModelParts
from common.rows_spec import RowsSpec
from common.tensor_codec import frame, wire_form
from common.wire_frames import TensorFrame


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


class Chain(Protocol):
    """The workers' part of a pipeline (coordinator/cluster/worker_chain.py)."""

    links: list
    broken: Exception | None

    def send(self, batch_id: int, spec: RowsSpec, hidden: TensorFrame, reply_slots=None): ...

    def collect(self) -> tuple[int, mx.array]: ...

    def release(self, seq_ids: list[int], wait: bool = True) -> None: ...

    def abort(self, error: Exception) -> None: ...

    def close(self) -> None: ...


class StagePipeline:
    def __init__(self, local: LayerRunner | None, chain: Chain | None = None) -> None:
        if local is None and chain is None:
            raise ValueError("a pipeline needs at least one stage")
        self.local = local  # the coordinator's own layers, first
        self.chain = chain  # then the workers, in layer order
        self._done: deque[tuple[int, mx.array]] = deque()
        # Micro-batches whose local layers are launched but not yet sent to the workers:
        # sent when the engine next waits for a reply, so building the next graph and
        # the device computing this one overlap.
        self._unsent: deque[tuple[int, RowsSpec, np.ndarray | None, int, mx.array]] = deque()
        self._failed: list[Exception] = []  # a local stage's failure, raised at collect
        # Micro-batches launched in an out-of-process local stage (a tensor group) whose
        # answers are not read yet: read at collect (then sent on to the workers, if any).
        self._in_group: deque[tuple[int, np.ndarray | None]] = deque()
        self._in_chain = 0  # micro-batches sent to the workers and not yet collected

    @property
    def _group(self):
        """The local stage when it runs out of process (launch/finish), else None."""
        return self.local if hasattr(self.local, "launch") else None

    @property
    def default_micro_batches(self) -> int:
        """One per stage, and one more when the first stage is a tensor group: this
        process then prepares a micro-batch while the group runs another."""
        return self.stages + (self._group is not None)

    @property
    def links(self) -> list:
        return self.chain.links if self.chain is not None else []

    @property
    def broken(self) -> Exception | None:
        return self.chain.broken if self.chain is not None else None

    @property
    def stages(self) -> int:
        return (self.local is not None) + len(self.links)

    def submit(
        self,
        batch_id: int,
        spec: RowsSpec,
        hidden: mx.array,
        reply_slots: np.ndarray | None = None,
    ) -> None:
        if self.chain is not None and self.chain.broken is not None:
            raise self.chain.broken
        if self._failed:  # nothing more is launched after a local stage's failure
            self._done.append((batch_id, None))
            return
        last = reply_slots if self.chain is None else None
        if self._group is not None:  # answered later, in order (collect)
            try:
                self._group.launch(spec, hidden, last)
            except Exception as e:  # a lost member: said when collected
                self._failed.append(e)
                return
            self._in_group.append((batch_id, reply_slots, spec))
            return
        if self.local is not None:  # the engine built the spec itself: no validation
            # the last stage keeps only the slots the head needs
            try:
                hidden = self.local.forward(spec, hidden, validate=False, reply_slots=last)
            except Exception as e:  # a tensor group's member lost: said when collected,
                self._failed.append(e)  # as a worker's failure is, with nothing applied
                self._done.append((batch_id, None))
                return
        if self.chain is None:
            out = hidden
            mx.async_eval(out)  # the device starts while the host plans the next one
            self._done.append((batch_id, out))
            return
        wire, raw = wire_form(hidden)
        mx.async_eval(raw)
        self._unsent.append((batch_id, spec, reply_slots, wire, raw))

    def _send_launched(self) -> None:
        while self._unsent:
            batch_id, spec, reply_slots, wire, raw = self._unsent.popleft()
            self.chain.send(batch_id, spec, frame(wire, raw), reply_slots)

    def collect(self) -> tuple[int, mx.array]:
        if self._failed:
            raise self._failed[0]
        if self._in_group:
            return self._collect_group()
        if self.chain is None:
            return self._done.popleft()
        self._send_launched()
        self._in_chain = max(0, self._in_chain - 1)
        return self.chain.collect()

    def _collect_group(self) -> tuple[int, mx.array]:
        """The oldest micro-batch, when a tensor group runs the first stage: its answer,
        or (with workers after it) the workers' for the oldest one sent to them."""
        if self.chain is not None and self._in_chain:
            self._in_chain -= 1
            return self.chain.collect()
        while self._in_group:  # every launched one: the workers run one, the group the next
            batch_id, reply_slots, spec = self._in_group.popleft()
            try:
                hidden = self._group.finish()
            except Exception as e:
                self._failed.append(e)
                raise
            if self.chain is None:
                return batch_id, hidden
            wire, raw = wire_form(hidden)
            self.chain.send(batch_id, spec, frame(wire, raw), reply_slots)
            self._in_chain += 1
        self._in_chain -= 1
        return self.chain.collect()

    @property
    def keeps_later(self) -> bool:
        """Whether a forward's permanent rows may be named after its launch (`keep`): every
        layer runs in this process. Workers and a tensor group (whose KV is in its
        processes) take the count with the forward itself."""
        return self.chain is None and getattr(self.local, "store", None) is not None

    def keep(self, seq_ids: list[int], counts: list[int]) -> None:
        """Rows the last forward of each sequence wrote past its length become permanent."""
        self.local.store.extend(seq_ids, counts)

    def forward(self, spec: RowsSpec, hidden: mx.array, batch_id: int = 1 << 40) -> mx.array:
        """One micro-batch, start to finish (nothing else may be in flight)."""
        self.submit(batch_id, spec, hidden)
        return self.collect()[1]

    def release(self, seq_ids: list[int], wait: bool = True) -> None:
        if self.local is not None:
            self.local.release(seq_ids)
        if self.chain is not None:
            self.chain.release(seq_ids, wait)

    def abort(self, error: Exception) -> None:
        if self.chain is not None:
            self.chain.abort(error)

    def close(self) -> None:
        self._unsent.clear()
        self._in_group.clear()
        if self.chain is not None:
            self.chain.close()


class LocalPipeline(StagePipeline):
    """Every layer in this process (the single-machine engine)."""

    def __init__(self, parts: ModelParts, kv: KVFormat = FULL) -> None:
        super().__init__(LayerRunner(parts, kv))
        self.runner = self.local
