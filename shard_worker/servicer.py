"""The Worker gRPC service: translates and validates messages, hands the work to the MLX
thread, and maps every refusal to a precise status. A refused call ends only that call
(for Forward: that stream); the worker keeps serving everything else."""

from __future__ import annotations

import functools
import logging
import re
import threading
import urllib.parse
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import asdict, dataclass
from typing import NoReturn

import grpc

from common import host_info, link_probe
from common.call_auth import MODEL_KEY, PROTOCOL_VERSION
from common.errors import CheckpointError, WedlmError, is_out_of_memory
from common.free_port import free_port
from common.grpc_services import MalformedRequest
from common.kv_format import KVFormat
from common.layer_range import LayerRange
from common.layer_runner import RowsError
from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.read_bandwidth import read_bandwidth
from common.tensor_codec import TensorFormatError
from common.tensor_group.member import GroupFailed
from common.tensor_group.rdma import RdmaPort
from common.tensor_group.spec import GroupSpec, rdma_rows, shard_problem
from common.wire_frames import Framed
from shard_worker.forward_request import hidden_of, reply_slots, rows_spec
from shard_worker.held_layers import HeldLayers
from shard_worker.layer_cache import CacheFull
from shard_worker.layer_fetch import FetchError, LayerFetcher
from shard_worker.mlx_thread import MLXThread, QueueFull, ThreadStopped
from shard_worker.peer_probe import PeerProbe
from shard_worker.stage_route import Failure, Plan, ReplyChannel, StageRoute
from shard_worker.worker_terminal import WorkerTerminal

log = logging.getLogger(__name__)
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}")


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


def _peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.5:51234", "ipv6:[::1]:51234")."""
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return urllib.parse.unquote(address).rsplit(":", 1)[0]


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(
        self,
        identity: WorkerIdentity,
        layers: HeldLayers,
        mlx: MLXThread,
        route: StageRoute,
        on_layers_changed: Callable[[], None] = lambda: None,
        fetcher: LayerFetcher | None = None,
        on_model_changed: Callable[[ModelConfig], None] = lambda _: None,
        group_backends: list[str] | None = None,
        group_host: str = "127.0.0.1",
        rdma_ports: list[RdmaPort] | None = None,
        peer_probe: PeerProbe | None = None,
        terminal: WorkerTerminal | None = None,
    ) -> None:
        self.route = route
        self.identity = identity
        self.model_name = identity.model_name
        self.layers = layers
        self.mlx = mlx
        self.on_layers_changed = on_layers_changed  # health status, Bonjour TXT
        self.fetcher = fetcher  # None: the worker has its own model folder
        self.on_model_changed = on_model_changed  # call checks, relays, Bonjour TXT
        self._fetching = threading.Lock()  # one fetch at a time: they share .part files
        self.group_backends = group_backends  # what tensor groups it can join
        self.rdma_ports = rdma_ports or []  # its Thunderbolt cables, for jaccl groups
        self.group_host = group_host
        self.group_port = free_port(group_host)  # where its next group process listens
        self.peer_probe = peer_probe or PeerProbe(None, None)
        self.read_bandwidth = 0.0  # bytes/s, measured at the first ProbeLink
        self.terminal = terminal or WorkerTerminal(identity.node_id)  # its state, as it changes
        if fetcher is not None and fetcher.terminal is None:
            fetcher.terminal = self.terminal

    @property
    def config(self) -> ModelConfig | None:
        return self.layers.config

    # ---- micro-batches ---------------------------------------------------------------
    def Forward(self, request_iterator, context):
        """The coordinator's stream. Its requests enter this stage; replies (when this is
        the last stage) and a broken relay come back on it."""
        self.terminal.heard()
        channel = self.route.attach()
        reader = threading.Thread(
            target=self._take_all, args=(request_iterator, channel), daemon=True
        )
        reader.start()
        for item in channel.items():
            if isinstance(item, Failure):
                self.route.detach(channel)
                context.abort(item.code, item.message)
            yield item
        self.route.detach(channel)

    def Relay(self, request_iterator, context):
        """The predecessor's stream: its outputs are this stage's inputs."""
        plan = self.route.plan
        if not plan.prev_stage:
            log.warning(
                "refused a relay from %s: this stage is fed by the coordinator", context.peer()
            )
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker takes no relays under plan {plan.epoch}: the coordinator feeds it",
            )
        received = self._take_all(request_iterator, None, context)
        return pb.RelayReply(received=received)

    def _take_all(self, requests, channel: ReplyChannel | None, context=None) -> int:
        """Take every request of one stream; stop at the first refused one (reported to the
        coordinator, and for a relay also to the sender)."""
        taken, problem = 0, None
        try:
            for request in requests:
                problem = self._take(request, channel)
                if problem is not None:
                    break
                taken += 1
        except grpc.RpcError:  # the sender went away: it reports for itself
            pass
        except Exception as e:  # a malformed frame
            problem = _status(e)
        if problem is not None:
            self.route.fail(*problem, origin=channel)
        if channel is not None:
            self._close_after_outputs(channel)
        if problem is not None and context is not None:
            context.abort(*problem)
        return taken

    def _close_after_outputs(self, channel: ReplyChannel) -> None:
        """End the stream once the forwards taken from it have answered (outputs are handed
        on in submission order, so a no-op job queued now comes after them)."""
        try:
            self.mlx.submit_pipelined(lambda: None, lambda _: None, lambda *_: channel.close())
        except (QueueFull, ThreadStopped):
            channel.close()

    def _take(self, request: Framed, origin: ReplyChannel | None):
        """Validate one micro-batch and queue it on the MLX thread; its output goes where
        the plan it arrived under says. Returns (code, message) when it is refused."""
        plan = self.route.plan
        if request.plan_epoch != plan.epoch:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"micro-batch {request.batch_id} belongs to plan {request.plan_epoch}; "
                f"this worker follows plan {plan.epoch}",
            )
        if self.layers.state.layer_range is None:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker holds no layers yet: it waits for the coordinator's Assign",
            )
        try:
            spec = rows_spec(request, self.config.hidden_size, self.config.max_position_embeddings)
            slots = reply_slots(request, spec)  # checked here, applied by the last stage
            hidden = hidden_of(request)
            if plan.next_stage:
                slots = None
            launch = functools.partial(self.layers.launch, spec, hidden, slots)
            header = request.message  # every field but the hidden states: relayed as is
            done = functools.partial(self._done, plan, header, origin)
            self.mlx.submit_pipelined(launch, self.layers.finish, done)
        except Exception as e:
            return _status(e)
        return None

    def _done(
        self,
        plan: Plan,
        request: pb.ForwardRequest,
        origin: ReplyChannel | None,
        result,
        queue_s: float,
    ) -> None:
        """On the MLX thread, in order: hand the output on (nothing here blocks)."""
        if isinstance(result, BaseException):
            self.route.fail(*_status(result), origin=origin)
            return
        hidden, compute_s = result
        request.stage_compute_s.append(compute_s)
        reply = pb.ForwardReply(
            batch_id=request.batch_id,
            compute_s=compute_s,
            queue_s=queue_s,
            stage_compute_s=request.stage_compute_s,
        )
        self.route.deliver(plan, request, reply, hidden, origin)

    def Route(self, request: pb.RouteRequest, context) -> pb.WorkerInfo:
        self.terminal.heard()
        for name in ("next_stage", "prev_stage"):
            value = getattr(request, name)
            if value and not _ADDRESS.fullmatch(value):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{name} {value!r} is not HOST:PORT"
                )
        try:
            self.route.follow(Plan(request.plan_epoch, request.next_stage, request.prev_stage))
        except Exception as e:
            self._abort(context, e)
        if (held := self.layers.state.layer_range) is not None:
            self.terminal.serving(held, self.model_name, request.plan_epoch, request.next_stage)
        return self.info()

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        self.terminal.heard()
        try:
            released = self.mlx.submit(self.layers.release, list(request.seq_ids)).result()
        except Exception as e:
            self._abort(context, e)
        return pb.ReleaseReply(released=released, kv_sequences=self.layers.state.kv_sequences)

    def Assign(self, request: pb.AssignRequest, context) -> pb.WorkerInfo:
        self.terminal.heard()
        start, end = request.layer_start, request.layer_end
        if start < 0 or end < start:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid layer range {start}-{end}")
        wanted = LayerRange(start, end)
        if self.fetcher is None:
            self._check_in_model(wanted, context)
        fixed = self.layers.fixed
        if fixed is not None and wanted != fixed:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker was started with --layers {fixed} and cannot take {wanted}",
            )
        if not request.fetch_only:
            self._say_assigned(request, wanted, context)
        if self.fetcher is not None:
            config = self._fetch(request, wanted, context)
            if request.fetch_only:
                return self.info()
            if self.config is None or config.identity != self.config.identity:
                try:
                    self.mlx.submit(self.layers.use_model, config).result()
                except Exception as e:
                    self._abort(context, e)
                self.on_model_changed(config)
        elif request.fetch_only:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker serves its own model folder and fetches no layers",
            )
        self._check_in_model(wanted, context)  # a fetched model is known only now
        try:
            kv = KVFormat(request.kv_bits or None, request.kv_group_size or 64)
            kv.check(self.config)
        except WedlmError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        group = self._group(request, context)
        try:
            self.mlx.submit(self.layers.load, wanted, kv, group).result()
        except Exception as e:
            self._abort(context, e)
        finally:
            if group is not None:  # that port is the group's now; the next group's is new
                self.group_port = free_port(self.group_host)
            self.on_layers_changed()
        return self.info()

    def _say_assigned(self, request: pb.AssignRequest, wanted: LayerRange, context) -> None:
        """The terminal's line for an Assign that changes what this worker holds (one for
        the range it holds already, under a re-plan, would say nothing new)."""
        identity = self._identity_of(context)
        same_model = self.config is not None and (
            self.fetcher is None or self.config.identity == identity
        )
        before = self.layers.state.layer_range if same_model else None
        if before == wanted:
            return
        model = self.model_name if same_model else ""
        if not model and self.fetcher is not None:  # known when it fetched this model before
            name = self.fetcher.cache.model_name(identity)
            model = name if name != identity else ""
        self.terminal.assigned(wanted, model, self._source_of(request, context), before)

    def _group(self, request: pb.AssignRequest, context) -> GroupSpec | None:
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
        if spec.backend not in self.group_backends:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker's MLX has no {spec.backend} backend "
                f"(it has: {', '.join(self.group_backends) or 'none'})",
            )
        problem = shard_problem(self.config, spec.size)
        if problem is not None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this model cannot be split {spec.size} ways: {problem}",
            )
        return spec

    def _check_in_model(self, wanted: LayerRange, context) -> None:
        num = self.config.num_layers
        if wanted.end >= num:
            context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"layer range {wanted} is past the model's {num} layers (0-{num - 1})",
            )

    def _fetch(self, request: pb.AssignRequest, wanted: LayerRange, context) -> ModelConfig:
        """The coordinator's model with `wanted` complete in the cache (fetched if missing)."""
        identity = self._identity_of(context)
        source = self._source_of(request, context)
        if not source:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker fetches its layers, but the coordinator named no model source",
            )
        if not _ADDRESS.fullmatch(source):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"model_source {source!r} is not HOST:PORT"
            )
        with self._fetching:
            try:
                config = self.fetcher.fetch(source, identity, wanted, request.fetch_only)
            except Exception as e:
                log.warning("fetching layers %s from %s failed: %s", wanted, source, e)
                self._abort(context, e)
        self.model_name = self.fetcher.cache.model_name(identity)
        return config

    @staticmethod
    def _identity_of(context) -> str:
        """The model the calling coordinator serves (its call's metadata)."""
        return dict(context.invocation_metadata() or ()).get(MODEL_KEY, "")

    @staticmethod
    def _source_of(request: pb.AssignRequest, context) -> str:
        """The coordinator's ModelSource address ("" when it named none)."""
        source = request.model_source
        if source.startswith(":"):  # the coordinator's port at the address it called from
            source = _peer_host(context.peer()) + source
        return source

    def Info(self, request: pb.InfoRequest, context) -> pb.WorkerInfo:
        self.terminal.heard()  # the coordinator's heartbeat, each second while in its plan
        return self.info()

    # ---- link survey (--tp auto) ----------------------------------------------------
    def Echo(self, request: pb.EchoRequest, context) -> pb.EchoReply:
        if len(request.payload) > link_probe.MAX_ECHO:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"an echo payload is at most {link_probe.MAX_ECHO} bytes, "
                f"not {len(request.payload)}",
            )
        return pb.EchoReply(received=len(request.payload))

    def ProbeLink(self, request: pb.ProbeLinkRequest, context) -> pb.ProbeLinkReply:
        """This worker's read bandwidth and, with a peer, its link's figures to it."""
        peer, timeout = request.peer, request.timeout_s or link_probe.DEFAULT_TIMEOUT_S
        if peer and not _ADDRESS.fullmatch(peer):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer!r} is not HOST:PORT")
        if not 0 < timeout <= link_probe.MAX_TIMEOUT_S:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout_s must be in (0, {link_probe.MAX_TIMEOUT_S:g}], not {timeout:g}",
            )
        if not self.read_bandwidth:
            try:  # once per process, on the thread that owns MLX
                self.read_bandwidth = self.mlx.submit(read_bandwidth).result()
            except Exception as e:
                self._abort(context, e)
        reply = pb.ProbeLinkReply(read_bandwidth=self.read_bandwidth)
        if peer:
            identity = dict(context.invocation_metadata() or ()).get(MODEL_KEY, "")
            reply.link.CopyFrom(self.peer_probe.measure(peer, identity, timeout))
        return reply

    def info(self) -> pb.WorkerInfo:
        state = self.layers.state
        held = state.layer_range
        config = self.config
        total, available = host_info.memory()
        cache = self.fetcher.cache if self.fetcher is not None else None
        return pb.WorkerInfo(
            node_id=self.identity.node_id,
            cluster=self.identity.cluster,
            protocol_version=PROTOCOL_VERSION,
            model_identity=config.identity if config else "",
            model_name=self.model_name,
            num_layers=config.num_layers if config else 0,
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
            plan_epoch=self.route.plan.epoch,
            next_stage=self.route.plan.next_stage,
            fetches_layers=cache is not None,
            cache_bytes=cache.total_bytes() if cache is not None else 0,
            kv_bits=state.kv.bits or 0,
            kv_group_size=state.kv.group_size,
            group_port=self.group_port,
            group_backends=self.group_backends,
            group_rank=state.group.rank if state.group else 0,
            group_size=state.group.size if state.group else 0,
            group_backend=state.group.backend if state.group else "",
            group_error=state.group_error,
            rdma_ports=[pb.RdmaPort(**asdict(p)) for p in self.rdma_ports],
            read_bandwidth=self.read_bandwidth,
        )

    @staticmethod
    def _abort(context, error: BaseException) -> NoReturn:
        code, message = _status(error)
        context.abort(code, message)
        raise AssertionError("context.abort returned")  # it always raises
