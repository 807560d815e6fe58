"""The gRPC status a worker call that failed ends with: each refusal mapped to a precise
code and message; an unexpected error is logged as a bug and answers INTERNAL."""

from __future__ import annotations

import logging
from concurrent.futures import CancelledError
from typing import NoReturn

import grpc

from common.errors import CheckpointError, is_out_of_memory
from common.grpc_services import MalformedRequest
from common.layer_runner import RowsError
from common.tensor_codec import TensorFormatError
from common.tensor_group.member import GroupFailed
from shard_worker.layer_cache import CacheFull
from shard_worker.layer_fetch import FetchError
from shard_worker.mlx_thread import QueueFull, ThreadStopped

log = logging.getLogger(__name__)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a failed job answers with; unexpected errors are logged as bugs."""
    if isinstance(error, RowsError):
        return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL), str(error)
    if isinstance(error, GroupFailed):
        return getattr(grpc.StatusCode, error.code), str(error)
    if isinstance(error, MalformedRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, TensorFormatError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"hidden states: {error}"
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker overloaded: {error}"
    if isinstance(error, ThreadStopped | CancelledError):
        return grpc.StatusCode.UNAVAILABLE, str(error) or "the call was cancelled"
    if isinstance(error, FetchError):
        return error.code, str(error)
    if isinstance(error, CacheFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, CheckpointError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    if isinstance(error, OSError):  # the layer cache's disk
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot write the layer cache: {error}"
    if is_out_of_memory(error):  # the coordinator retries with fewer sequences
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {error}"
    log.error("unexpected error in a worker call", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


def abort(context, error: BaseException) -> NoReturn:
    """End the call with the status `error` maps to."""
    code, message = status_of(error)
    context.abort(code, message)
    raise AssertionError("context.abort returned")  # it always raises
