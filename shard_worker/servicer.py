"""The Worker gRPC service: translates and validates messages, hands the work to the MLX
thread, and maps every refusal to a precise status. A refused call ends only that call
(for Forward: that stream); the worker keeps serving everything else."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

import grpc

from common import host_info, link_probe
from common.call_auth import PROTOCOL_VERSION
from common.errors import WedlmError
from common.free_port import free_port
from common.kv_format import KVFormat
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.read_bandwidth import read_bandwidth
from common.tensor_group.rdma import RdmaPort
from shard_worker.call_checks import ADDRESS, check_in_model, group_spec, identity_of, source_of
from shard_worker.call_status import abort
from shard_worker.forward_streams import ForwardStreams
from shard_worker.held_layers import HeldLayers
from shard_worker.layer_fetch import LayerFetcher
from shard_worker.mlx_thread import MLXThread
from shard_worker.peer_probe import PeerProbe
from shard_worker.stage_route import Plan, StageRoute
from shard_worker.worker_terminal import WorkerTerminal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerIdentity:
    node_id: str
    cluster: str
    model_name: str
    device: str


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
        self.streams = ForwardStreams(layers, mlx, route, self.terminal)

    @property
    def config(self) -> ModelConfig | None:
        return self.layers.config

    # ---- micro-batches (forward_streams.py) --------------------------------------------
    def Forward(self, request_iterator, context):
        """The coordinator's stream: micro-batches in, replies and failures back."""
        yield from self.streams.forward(request_iterator, context)

    def Relay(self, request_iterator, context) -> pb.RelayReply:
        """The predecessor stage's stream: its outputs are this stage's inputs."""
        return self.streams.relay(request_iterator, context)

    def Route(self, request: pb.RouteRequest, context) -> pb.WorkerInfo:
        self.terminal.heard()
        for name in ("next_stage", "prev_stage"):
            value = getattr(request, name)
            if value and not ADDRESS.fullmatch(value):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{name} {value!r} is not HOST:PORT"
                )
        try:
            self.route.follow(Plan(request.plan_epoch, request.next_stage, request.prev_stage))
        except Exception as e:
            abort(context, e)
        if (held := self.layers.state.layer_range) is not None:
            self.terminal.serving(held, self.model_name, request.plan_epoch, request.next_stage)
        return self.info()

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        self.terminal.heard()
        try:
            released = self.mlx.submit(self.layers.release, list(request.seq_ids)).result()
        except Exception as e:
            abort(context, e)
        return pb.ReleaseReply(released=released, kv_sequences=self.layers.state.kv_sequences)

    def Assign(self, request: pb.AssignRequest, context) -> pb.WorkerInfo:
        self.terminal.heard()
        start, end = request.layer_start, request.layer_end
        if start < 0 or end < start:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid layer range {start}-{end}")
        wanted = LayerRange(start, end)
        if self.fetcher is None:
            check_in_model(wanted, context, self.config)
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
                    abort(context, e)
                self.on_model_changed(config)
        elif request.fetch_only:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker serves its own model folder and fetches no layers",
            )
        check_in_model(wanted, context, self.config)  # a fetched model is known only now
        try:
            kv = KVFormat(request.kv_bits or None, request.kv_group_size or 64)
            kv.check(self.config)
        except WedlmError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        group = group_spec(request, context, self.group_backends, self.config)
        try:
            self.mlx.submit(self.layers.load, wanted, kv, group).result()
        except Exception as e:
            abort(context, e)
        finally:
            if group is not None:  # that port is the group's now; the next group's is new
                self.group_port = free_port(self.group_host)
            self.on_layers_changed()
        return self.info()

    def _say_assigned(self, request: pb.AssignRequest, wanted: LayerRange, context) -> None:
        """The terminal's line for an Assign that changes what this worker holds (one for
        the range it holds already, under a re-plan, would say nothing new)."""
        identity = identity_of(context)
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
        self.terminal.assigned(wanted, model, source_of(request, context), before)

    def _fetch(self, request: pb.AssignRequest, wanted: LayerRange, context) -> ModelConfig:
        """The coordinator's model with `wanted` complete in the cache (fetched if missing)."""
        identity = identity_of(context)
        source = source_of(request, context)
        if not source:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker fetches its layers, but the coordinator named no model source",
            )
        if not ADDRESS.fullmatch(source):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"model_source {source!r} is not HOST:PORT"
            )
        with self._fetching:
            try:
                config = self.fetcher.fetch(source, identity, wanted, request.fetch_only)
            except Exception as e:
                log.warning("fetching layers %s from %s failed: %s", wanted, source, e)
                abort(context, e)
        self.model_name = self.fetcher.cache.model_name(identity)
        return config

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
        if peer and not ADDRESS.fullmatch(peer):
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
                abort(context, e)
        reply = pb.ProbeLinkReply(read_bandwidth=self.read_bandwidth)
        if peer:
            identity = identity_of(context)
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
