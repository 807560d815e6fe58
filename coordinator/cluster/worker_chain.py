"""The workers' stages as one chain. A micro-batch's hidden states go to the first worker;
each worker relays its output straight to the next (protocol 3), and the last one answers
on its Forward stream, carrying only the slots the coordinator takes logits of. The
coordinator keeps a Forward stream open to every stage: any stage ends its stream with
the reason when it cannot go on (its successor is gone), so a broken link anywhere breaks
the chain at once."""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
import mlx.core as mx
import numpy as np

from common.proto_gen import wedlm_pb2 as pb
from common.rows_spec import RowsSpec
from common.tensor_codec import decode
from common.wire_frames import TensorFrame, with_tensor
from coordinator.cluster.worker_link import WorkerCallError, WorkerLink

log = logging.getLogger(__name__)


def forward_request(
    batch_id: int,
    spec: RowsSpec,
    hidden: pb.Tensor | TensorFrame,
    reply_slots: np.ndarray | None = None,
    plan_epoch: int = 0,
) -> bytes:
    """A serialized ForwardRequest; the hidden states are framed by hand (one copy).
    `reply_slots` ([B, S]): the slots the last stage's reply carries."""
    frame = hidden if isinstance(hidden, TensorFrame) else TensorFrame.of(hidden)
    header = forward_header(batch_id, spec, reply_slots, plan_epoch)
    return with_tensor(header, "hidden", frame)


def forward_header(
    batch_id: int, spec: RowsSpec, reply_slots: np.ndarray | None, plan_epoch: int
) -> pb.ForwardRequest:
    """A ForwardRequest without its hidden states (framed by hand when it is sent)."""
    header = pb.ForwardRequest(
        batch_id=batch_id,
        seq_ids=spec.seq_ids,
        committed=spec.starts.tolist(),
        widths=spec.widths.tolist(),
        keep=spec.keeps.tolist(),
        filled=np.ascontiguousarray(spec.slot_kinds()).tobytes(),
        slot_offsets=(
            b"" if spec.offsets is None else np.ascontiguousarray(spec.offsets, "<i4").tobytes()
        ),
        canvas_extent=[] if spec.extent is None else [int(e) for e in spec.extent],
        positions=spec.starts.tolist(),
        plan_epoch=plan_epoch,
        forks=[pb.KVFork(seq_id=d, source=s, length=n) for d, s, n in spec.forks],
    )
    if reply_slots is not None:
        header.reply_rows.per_row = reply_slots.shape[1]
        header.reply_rows.slots.extend(reply_slots.reshape(-1).tolist())
    return header


class WorkerChain:
    def __init__(self, links: list[WorkerLink], plan_epoch: int, deadline_s: float = 30.0):
        self.links = links  # in layer order
        self.plan_epoch = plan_epoch
        self.deadline_s = deadline_s
        self._done: queue.Queue = queue.Queue()
        self._sent: dict[int, float] = {}
        self._lock = threading.Lock()
        self.broken: WorkerCallError | None = None  # set once a stage is lost
        for stage, link in enumerate(links):
            link.on_reply = self._receiver(stage)
        for link in links:
            link.open()

    def _receiver(self, stage: int):
        last = stage + 1 == len(self.links)

        def receive(item: pb.ForwardReply | WorkerCallError) -> None:
            if isinstance(item, WorkerCallError) or last:
                self._done.put(item)
            else:  # only the last stage answers: anything else is a protocol error
                self._done.put(
                    WorkerCallError(
                        self.links[stage].address,
                        grpc.StatusCode.INTERNAL,
                        "a middle stage answered the coordinator (a worker of another protocol?)",
                    )
                )

        return receive

    def send(
        self,
        batch_id: int,
        spec: RowsSpec,
        hidden: TensorFrame,
        reply_slots: np.ndarray | None = None,
    ) -> None:
        """Into the first stage; `reply_slots` None: the reply carries every slot."""
        if self.broken is not None:
            raise self.broken
        with self._lock:
            self._sent[batch_id] = time.perf_counter()
        header = forward_header(batch_id, spec, reply_slots, self.plan_epoch)
        self.links[0].send((header, hidden))  # framed on the stream's thread

    def collect(self) -> tuple[int, mx.array]:
        """The oldest micro-batch's id and final hidden states (blocks)."""
        try:
            reply = self._done.get(timeout=self.deadline_s * len(self.links))
        except queue.Empty:
            raise WorkerCallError(
                "pipeline", grpc.StatusCode.DEADLINE_EXCEEDED, "no reply from the last worker"
            ) from None
        if isinstance(reply, WorkerCallError):
            self.broken = reply
            raise reply
        with self._lock:
            sent = self._sent.pop(reply.batch_id, None)
        roundtrip = time.perf_counter() - sent if sent is not None else 0.0
        for link, compute in zip(self.links, reply.stage_compute_s, strict=False):
            link.stats.add(compute, roundtrip)
        return reply.batch_id, decode(reply.hidden)

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
        """A stage stopped answering heartbeats: fail what is pending and what comes."""
        self.broken = error
        self._done.put(error)

    def close(self) -> None:
        for link in self.links:
            link.close()
