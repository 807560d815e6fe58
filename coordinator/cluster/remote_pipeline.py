"""Runs the layers on the workers. A micro-batch's hidden states go to the first worker;
each worker's reply is relayed to the next worker as soon as it arrives (by that link's
reader thread, touching only bytes), so several micro-batches can be in flight at once,
one per pipeline stage. The last worker's replies come back in order, carrying only the
slots the coordinator takes logits of."""

from __future__ import annotations

import itertools
import logging
import queue
import threading

import grpc
import mlx.core as mx
import numpy as np

from common.proto_gen import wedlm_pb2 as pb
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, encode_frame
from common.wire_frames import TensorFrame, with_tensor
from coordinator.cluster.worker_link import WorkerCallError, WorkerLink

log = logging.getLogger(__name__)


def forward_request(
    batch_id: int,
    spec: RowsSpec,
    hidden: pb.Tensor | TensorFrame,
    reply_slots: np.ndarray | None = None,
) -> bytes:
    """A serialized ForwardRequest; the hidden states are framed by hand (one copy).
    `reply_slots` ([B, S]) only for the last worker: the slots its reply carries."""
    header = pb.ForwardRequest(
        batch_id=batch_id,
        seq_ids=spec.seq_ids,
        committed=spec.starts.tolist(),
        widths=spec.widths.tolist(),
        keep=spec.keeps.tolist(),
        filled=np.ascontiguousarray(spec.filled, dtype=np.uint8).tobytes(),
        positions=spec.starts.tolist(),
    )
    if reply_slots is not None:
        header.reply_rows.per_row = reply_slots.shape[1]
        header.reply_rows.slots.extend(reply_slots.reshape(-1).tolist())
    frame = hidden if isinstance(hidden, TensorFrame) else TensorFrame.of(hidden)
    return with_tensor(header, "hidden", frame)


class RemotePipeline:
    def __init__(self, links: list[WorkerLink], deadline_s: float = 30.0) -> None:
        self.links = links  # in layer order
        self.deadline_s = deadline_s
        self._ids = itertools.count(1)
        self._specs: dict[int, tuple[RowsSpec, np.ndarray | None]] = {}
        self._lock = threading.Lock()
        self._done: queue.Queue = queue.Queue()
        self.broken: WorkerCallError | None = None  # set once a worker is lost
        for stage, link in enumerate(links):
            link.on_reply = self._relay_from(stage)

    def _relay_from(self, stage: int):
        def relay(reply: pb.ForwardReply | WorkerCallError) -> None:
            if isinstance(reply, WorkerCallError) or stage + 1 == len(self.links):
                self._done.put(reply)
                return
            with self._lock:
                entry = self._specs.get(reply.batch_id)
            if entry is None:  # abandoned after a failure
                return
            self._send(stage + 1, reply.batch_id, *entry, reply.hidden)

        return relay

    def submit(
        self,
        batch_id: int,
        spec: RowsSpec,
        hidden: mx.array,
        reply_slots: np.ndarray | None = None,
    ) -> None:
        """`reply_slots` None: the reply carries every slot (as `forward` needs)."""
        if self.broken is not None:
            raise self.broken
        with self._lock:
            self._specs[batch_id] = (spec, reply_slots)
        self._send(0, batch_id, spec, reply_slots, encode_frame(hidden))

    def _send(
        self,
        stage: int,
        batch_id: int,
        spec: RowsSpec,
        reply_slots: np.ndarray | None,
        hidden: pb.Tensor | TensorFrame,
    ) -> None:
        """Only the last worker's reply is cut to `reply_slots`: the others feed a worker."""
        last = stage + 1 == len(self.links)
        request = forward_request(batch_id, spec, hidden, reply_slots if last else None)
        self.links[stage].send(request)

    def collect(self) -> tuple[int, mx.array]:
        try:
            reply = self._done.get(timeout=self.deadline_s * len(self.links))
        except queue.Empty:
            raise WorkerCallError(
                "pipeline", grpc.StatusCode.DEADLINE_EXCEEDED, "no reply from the last worker"
            ) from None
        if isinstance(reply, WorkerCallError):
            with self._lock:
                self._specs.clear()
            self.broken = reply
            raise reply
        with self._lock:
            self._specs.pop(reply.batch_id, None)
        return reply.batch_id, decode(reply.hidden)

    def forward(self, spec: RowsSpec, hidden: mx.array) -> mx.array:
        """One micro-batch, start to finish (nothing else may be in flight)."""
        batch_id = next(self._ids) + (1 << 40)
        self.submit(batch_id, spec, hidden)
        return self.collect()[1]

    def release(self, seq_ids: list[int], wait: bool = True) -> None:
        """Best effort: a worker that cannot be reached holds nothing we will reuse.
        Without `wait` the calls go out and the engine thread moves on (a finished
        sequence's id is never used again, so nothing depends on when they land)."""
        for link in self.links:
            if not wait:
                link.release_soon(seq_ids)
                continue
            try:
                link.release(seq_ids)
            except WorkerCallError as e:
                log.warning("release on %s failed: %s", link.address, e)

    def abort(self, error: WorkerCallError) -> None:
        """A worker stopped answering heartbeats: fail what is pending and what comes."""
        self.broken = error
        self._done.put(error)

    def close(self) -> None:
        for link in self.links:
            link.close()
