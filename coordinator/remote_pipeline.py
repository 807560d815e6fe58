"""Runs the layers on the workers: hidden states go to the first worker, each reply's
tensor goes unchanged to the next, and the last reply comes back as an MLX array."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np

from common.proto_gen import wedlm_pb2 as pb
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, encode
from coordinator.worker_link import WorkerLink


def forward_request(batch_id: int, spec: RowsSpec, hidden: pb.Tensor) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        batch_id=batch_id,
        seq_ids=spec.seq_ids,
        committed=spec.starts.tolist(),
        widths=spec.widths.tolist(),
        keep=spec.keeps.tolist(),
        filled=np.ascontiguousarray(spec.filled, dtype=np.uint8).tobytes(),
        positions=spec.starts.tolist(),
        hidden=hidden,
    )


class RemotePipeline:
    def __init__(self, links: list[WorkerLink]) -> None:
        self.links = links  # in layer order
        self._ids = itertools.count(1)

    def forward(self, spec: RowsSpec, hidden: mx.array) -> mx.array:
        batch_id = next(self._ids)
        tensor = encode(hidden)
        for link in self.links:
            link.send(forward_request(batch_id, spec, tensor))
            tensor = link.receive().hidden
        return decode(tensor)

    def release(self, seq_ids: list[int]) -> None:
        for link in self.links:
            link.release(seq_ids)

    def close(self) -> None:
        for link in self.links:
            link.close()
