"""Puts a worker together: its layers on the MLX thread, the gRPC server with cluster
authentication and health checking, and its Bonjour advertisement."""

from __future__ import annotations

import contextlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import host_info
from common.call_auth import PROTOCOL_VERSION, ClusterAuthInterceptor
from common.discovery_record import WorkerAdvert
from common.errors import WedlmError
from common.grpc_services import SERVER_PING_POLICY, add_service
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.tensor_group.rdma import rdma_ports
from common.tensor_group.spec import available_backends
from common.tls import TlsConfig, bind
from common.wire_frames import framed_parser
from shard_worker.bonjour import BonjourAdvert
from shard_worker.held_layers import HeldLayers
from shard_worker.layer_cache import LayerCache
from shard_worker.layer_fetch import LayerFetcher
from shard_worker.mlx_thread import MLXThread
from shard_worker.peer_probe import PeerProbe
from shard_worker.servicer import WorkerIdentity, WorkerServicer
from shard_worker.stage_route import StageRoute

SERVICE_NAME = "wedlm.v1.Worker"
MAX_MESSAGE = 256 << 20
STOP_WAIT_S = 60.0  # for the MLX thread's work in progress, at stop
HANDLER_THREADS = 64  # each open Forward stream holds one thread for its lifetime
MAX_CONCURRENT_RPCS = 48  # fewer than the threads, so Info and Release always find one
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),  # a second worker on a taken port must fail, not share it
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    *SERVER_PING_POLICY,
]


def _check_port_free(host: str, port: int) -> None:
    """Fail with the OS's reason before gRPC tries (it only logs a terse line)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind((host, port))
        except OSError as e:
            raise WedlmError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


@dataclass(frozen=True)
class WorkerOptions:
    config: ModelConfig | None  # None: take the coordinator's model, fetching the layers
    layers: LayerRange | None  # fixed with --layers, else assigned by the coordinator
    host: str = "127.0.0.1"
    port: int = 0
    cluster: str = "default"
    secret: str | None = None
    node_id: str | None = None
    bonjour: bool = True
    advertise_host: str | None = None
    tls: TlsConfig = field(default_factory=TlsConfig)
    cache: LayerCache | None = None  # where fetched layers go (a worker without a model)
    fetch_limit: float | None = None  # bytes per second a fetch may take (None: no limit)


class WorkerServer:
    def __init__(self, options: WorkerOptions) -> None:
        """Load the fixed range (if any) and bind; raises WedlmError for bad input."""
        self.options = options
        config = options.config
        self.mlx = MLXThread()
        self.mlx.call(host_info.wire_model_memory)
        self.layers: HeldLayers = self.mlx.call(HeldLayers, config, options.layers)
        if options.layers is not None:
            self.mlx.call(self.layers.load, options.layers)
        fetching = config is None
        if fetching and options.cache is None:
            raise WedlmError("a worker without a model needs a layer cache")
        self.auth = ClusterAuthInterceptor(options.secret, config.identity if config else "")
        # A link probe carries no model's work; a coordinator of any model may probe a
        # fetching worker and assign it layers.
        open_to_any = ("Echo", "Info", "Assign", "ProbeLink") if fetching else ("Echo",)
        self.auth.any_model = frozenset(f"/{SERVICE_NAME}/{m}" for m in open_to_any)
        self.server = grpc.server(
            ThreadPoolExecutor(max_workers=HANDLER_THREADS, thread_name_prefix="grpc"),
            interceptors=[self.auth],
            options=GRPC_OPTIONS,
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        _check_port_free(options.host, options.port)
        host = f"[{options.host}]" if ":" in options.host else options.host
        try:
            self.port = bind(self.server, f"{host}:{options.port}", options.tls)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise WedlmError(f"cannot listen on {options.host}:{options.port} (in use?)")
        self.node_id = host_info.node_id(self.port, options.node_id)
        # caches its device queries; handlers then read only MLX's allocator counter
        self.mlx.call(host_info.memory)
        identity = WorkerIdentity(
            node_id=self.node_id,
            cluster=options.cluster,
            model_name=config.path.name if config else "",
            device=self.mlx.call(host_info.device_description),
        )
        self.route = StageRoute(options.secret, self.auth.model_identity, options.tls)
        fetcher = (
            LayerFetcher(
                options.cache, options.secret, options.tls, self.node_id, options.fetch_limit
            )
            if fetching
            else None
        )
        rdma = rdma_ports()  # Thunderbolt cables with RDMA (none off macOS): jaccl groups
        self.servicer = WorkerServicer(
            identity,
            self.layers,
            self.mlx,
            self.route,
            on_layers_changed=self._layers_changed,
            fetcher=fetcher,
            on_model_changed=self._model_changed,
            group_backends=self.mlx.call(lambda: available_backends(rdma)),
            rdma_ports=rdma,
            group_host=options.host if options.host not in ("0.0.0.0", "::") else "",
            peer_probe=PeerProbe(options.secret, options.tls),
        )
        framed = framed_parser(pb.ForwardRequest, "hidden")  # hidden states stay unparsed
        add_service(self.server, self.servicer, "Worker", {"Forward": framed, "Relay": framed})
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._set_health()
        self.bonjour = (
            BonjourAdvert(options.host, self.port, options.advertise_host)
            if options.bonjour
            else None
        )

    def start(self) -> None:
        self.server.start()
        if self.bonjour:
            self.bonjour.start(self.advert())

    def stop(self, grace: float = 2.0, wait_s: float = STOP_WAIT_S) -> bool:
        """Withdraw the advertisement, finish calls in flight for `grace` s, then end the
        MLX thread and wait for it (up to `wait_s`: a layer load in progress is not waited
        for longer): no MLX work may outlive a clean stop (the process exits next; see
        common/mlx_thread_exit.py). Returns whether the MLX thread ended; if not, the
        process must leave without the interpreter's shutdown (cli.py)."""
        self.health.enter_graceful_shutdown()
        if self.bonjour:
            self.bonjour.close()
        self.route.close()
        self.server.stop(grace).wait(grace + 1.0)
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(Exception):  # a stopping thread takes no more work
            self.mlx.submit(self.layers.close).result(timeout=wait_s)
        return self.mlx.stop(timeout=max(deadline - time.monotonic(), 0.1))

    def advert(self) -> WorkerAdvert:
        total, available = host_info.memory()
        fixed = self.options.layers
        return WorkerAdvert(
            node_id=self.node_id,
            cluster=self.options.cluster,
            protocol=PROTOCOL_VERSION,
            device=self.servicer.identity.device,
            memory_total=total,
            memory_available=available,
            layers=str(fixed) if fixed else "",
            model=self.auth.model_identity,
            model_name=self.servicer.model_name,
        )

    def _set_health(self) -> None:
        serving = self.layers.state.layer_range is not None
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _model_changed(self, config: ModelConfig) -> None:
        """A fetching worker took another model: calls, relays and the advert follow it."""
        self.auth.model_identity = config.identity
        self.route.use_model(config.identity)
        self._layers_changed()

    def _layers_changed(self) -> None:
        self._set_health()
        if self.bonjour:
            self.bonjour.update(self.advert())
