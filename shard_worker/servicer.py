"""The Worker gRPC service: translates and validates messages, hands the work to the MLX
thread, and maps every refusal to a precise status. A refused call ends only that call
(for Forward: that stream); the worker keeps serving everything else."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import NoReturn

import grpc

from common import host_info
from common.call_auth import PROTOCOL_VERSION
from common.errors import CheckpointError
from common.layer_range import LayerRange
from common.layer_runner import RowsError
from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.tensor_codec import TensorFormatError
from common.wire_frames import with_tensor
from shard_worker.forward_request import reply_slots, rows_spec
from shard_worker.held_layers import HeldLayers
from shard_worker.mlx_thread import MLXThread, QueueFull, ThreadStopped

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerIdentity:
    node_id: str
    cluster: str
    model_name: str
    device: str


def _status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a failed job answers with; unexpected errors are logged as bugs."""
    if isinstance(error, RowsError):
        return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL), str(error)
    if isinstance(error, TensorFormatError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"hidden states: {error}"
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker overloaded: {error}"
    if isinstance(error, ThreadStopped | CancelledError):
        return grpc.StatusCode.UNAVAILABLE, str(error) or "the call was cancelled"
    if isinstance(error, CheckpointError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    if isinstance(error, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {error}"
    log.error("unexpected error in a worker call", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(
        self,
        identity: WorkerIdentity,
        config: ModelConfig,
        layers: HeldLayers,
        mlx: MLXThread,
        on_layers_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.identity = identity
        self.config = config
        self.layers = layers
        self.mlx = mlx
        self.on_layers_changed = on_layers_changed  # health status, Bonjour TXT

    def Forward(self, request_iterator, context):
        for request in request_iterator:
            yield self._forward(request, context)

    def _forward(self, request: pb.ForwardRequest, context) -> bytes:
        """The serialized reply (its hidden states framed by hand: one copy)."""
        if self.layers.state.layer_range is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker holds no layers yet: it waits for the coordinator's Assign",
            )
        try:
            spec = rows_spec(request, self.config.hidden_size, self.config.max_position_embeddings)
            slots = reply_slots(request, spec)
            future = self.mlx.submit(
                self.layers.forward, spec, request.hidden, slots, alive=context.is_active
            )
            hidden, compute_s = future.result()
        except Exception as e:
            self._abort(context, e)
        header = pb.ForwardReply(
            batch_id=request.batch_id, compute_s=compute_s, queue_s=future.queue_s
        )
        return with_tensor(header, "hidden", hidden)

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        try:
            released = self.mlx.submit(self.layers.release, list(request.seq_ids)).result()
        except Exception as e:
            self._abort(context, e)
        return pb.ReleaseReply(released=released, kv_sequences=self.layers.state.kv_sequences)

    def Assign(self, request: pb.AssignRequest, context) -> pb.WorkerInfo:
        start, end, num = request.layer_start, request.layer_end, self.config.num_layers
        if start < 0 or end < start:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid layer range {start}-{end}")
        if end >= num:
            context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"layer range {start}-{end} is past the model's {num} layers (0-{num - 1})",
            )
        wanted = LayerRange(start, end)
        fixed = self.layers.fixed
        if fixed is not None and wanted != fixed:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker was started with --layers {fixed} and cannot take {wanted}",
            )
        try:
            self.mlx.submit(self.layers.load, wanted).result()
        except Exception as e:
            self._abort(context, e)
        finally:
            self.on_layers_changed()
        return self.info()

    def Info(self, request: pb.InfoRequest, context) -> pb.WorkerInfo:
        return self.info()

    def info(self) -> pb.WorkerInfo:
        state = self.layers.state
        held = state.layer_range
        total, available = host_info.memory()
        return pb.WorkerInfo(
            node_id=self.identity.node_id,
            cluster=self.identity.cluster,
            protocol_version=PROTOCOL_VERSION,
            model_identity=self.config.identity,
            model_name=self.identity.model_name,
            num_layers=self.config.num_layers,
            has_layers=held is not None,
            layer_start=held.start if held else 0,
            layer_end=held.end if held else -1,  # an empty range while unassigned
            fixed_range=self.layers.fixed is not None,
            device=self.identity.device,
            memory_total=total,
            memory_available=available,
            layer_bytes=state.layer_bytes,
            kv_bytes_per_token=state.kv_bytes_per_token,
            kv_sequences=state.kv_sequences,
            kv_bytes=state.kv_bytes,
            hidden_dtype=state.dtype,
        )

    @staticmethod
    def _abort(context, error: BaseException) -> NoReturn:
        code, message = _status(error)
        context.abort(code, message)
        raise AssertionError("context.abort returned")  # it always raises
