"""The coordinator's own layers held as rank 0 of a tensor group: its group process runs
them with the other members, and this stands where the in-process LayerRunner stands in
the pipeline. Its forwards are launched and answered later, in order, as a worker chain's
are (`launch`, `finish`): the engine prepares the next micro-batch while the group runs.
The KV lives in the group, so the pipeline names every forward's permanent rows with the
forward itself (no look-ahead keeps)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.layer_range import LayerRange
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, wire_form
from common.tensor_group.member import GroupMember
from common.wire_frames import WireTensor


class GroupStage:
    store = None  # the KV is in the group process

    def __init__(self, member: GroupMember) -> None:
        self.member = member

    @property
    def layer_range(self) -> LayerRange:
        return self.member.layer_range

    def launch(
        self, spec: RowsSpec, hidden: mx.array, reply_slots: np.ndarray | None = None
    ) -> None:
        """Hand a forward to the group and return (its answer: `finish`, in order); with
        `reply_slots`, only those slots come back (a prompt chunk's last row)."""
        wire, raw = wire_form(hidden)
        host = np.array(raw)  # the embedding (and nothing else) evaluated here
        self.member.launch(spec, WireTensor(wire, host.shape, host.tobytes()), reply_slots)

    def finish(self) -> mx.array:
        """The oldest launched forward's output (raises GroupFailed when a member is lost:
        the engine then plans again, as for a lost worker)."""
        out, _ = self.member.finish()
        return decode(out)

    def forward(
        self,
        spec: RowsSpec,
        hidden: mx.array,
        validate: bool = False,
        reply_slots: np.ndarray | None = None,
    ) -> mx.array:
        """One forward, start to finish (nothing else in flight)."""
        self.launch(spec, hidden, reply_slots)
        return self.finish()

    def release(self, seq_ids: list[int]) -> None:
        self.member.release(list(dict.fromkeys(seq_ids)))

    def close(self) -> None:
        self.member.stop()
