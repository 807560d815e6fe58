"""What a worker checks in the coordinator's calls before acting on them: addresses,
the calling coordinator's model and ModelSource, an Assign's layer range and tensor group.
A refusal aborts the call with INVALID_ARGUMENT, FAILED_PRECONDITION or OUT_OF_RANGE."""

from __future__ import annotations

import re
import urllib.parse

import grpc

from common.call_auth import MODEL_KEY
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.tensor_group.spec import GroupSpec, rdma_rows, shard_problem

ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}")  # HOST:PORT


def _peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.5:51234", "ipv6:[::1]:51234")."""
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return urllib.parse.unquote(address).rsplit(":", 1)[0]


def identity_of(context) -> str:
    """The model the calling coordinator serves (its call's metadata)."""
    return dict(context.invocation_metadata() or ()).get(MODEL_KEY, "")


def source_of(request: pb.AssignRequest, context) -> str:
    """The coordinator's ModelSource address ("" when it named none)."""
    source = request.model_source
    if source.startswith(":"):  # the coordinator's port at the address it called from
        source = _peer_host(context.peer()) + source
    return source


def check_in_model(wanted: LayerRange, context, config: ModelConfig) -> None:
    """Refuse a range past the model's last layer (OUT_OF_RANGE)."""
    num = config.num_layers
    if wanted.end >= num:
        context.abort(
            grpc.StatusCode.OUT_OF_RANGE,
            f"layer range {wanted} is past the model's {num} layers (0-{num - 1})",
        )


def group_spec(
    request: pb.AssignRequest, context, backends: list[str] | None, config: ModelConfig
) -> GroupSpec | None:
    """The tensor group the Assign names, checked (None: hold the range alone)."""
    if not request.HasField("group"):
        return None
    g = request.group
    rdma = rdma_rows(list(g.rdma_devices), g.size)
    spec = GroupSpec(g.rank, g.size, list(g.hosts), g.backend, g.epoch, rdma)
    try:
        spec.check()
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"group: {e}")
    if spec.backend not in backends:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this worker's MLX has no {spec.backend} backend "
            f"(it has: {', '.join(backends) or 'none'})",
        )
    problem = shard_problem(config, spec.size)
    if problem is not None:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this model cannot be split {spec.size} ways: {problem}",
        )
    return spec
