"""`wedlm-coordinator serve`: load the model's ends and tokenizer, start the gRPC service,
find and verify workers, plan and assign layers, then start the engine thread."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.errors import WedlmError
from common.grpc_services import add_service
from common.model_parts import load_model_parts
from common.proto_gen import wedlm_pb2 as pb
from common.tls import TlsConfig, bind
from common.tokenizer import Tokenizer
from coordinator.cluster.cluster_setup import WorkerEntry, assemble, pipeline_links
from coordinator.cluster.discovery import WorkerBrowser, parse_static, wait_for_workers
from coordinator.cluster.heartbeat import Heartbeat
from coordinator.cluster.remote_pipeline import RemotePipeline
from coordinator.cluster.worker_link import MESSAGE_LIMIT, WorkerCallError
from coordinator.engine.engine import Engine, Limits
from coordinator.service.engine_loop import EngineLoop
from coordinator.service.job_store import JobStore
from coordinator.service.jobs import JobRegistry
from coordinator.service.metrics import Metrics
from coordinator.service.servicer import CoordinatorServicer

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    model: Path
    host: str = "127.0.0.1"
    port: int = 50051
    cluster: str = "default"
    secret: str | None = None
    workers: list[str] = field(default_factory=list)
    expect: int = 1
    bonjour: bool = True
    max_running: int = 16
    max_queued: int = 256
    max_queued_tokens: int = 1 << 20
    micro_batches: int = 0  # 0: one per pipeline stage
    metrics_port: int | None = None
    wait_timeout_s: float = 600.0
    recovery_timeout_s: float = 600.0  # how long to wait for workers after a loss
    kv_reserve_tokens: int = 32768
    keep_finished: int = 10_000  # finished jobs kept (memory stays bounded by this)
    state_dir: Path | None = None  # where accepted jobs are kept (None: not kept)
    tls: TlsConfig = field(default_factory=TlsConfig)  # serves clients, dials workers


class _NotReady:
    def submit(self, batch_id, spec, hidden):
        raise WedlmError("no workers are planned yet")

    def collect(self):
        raise WedlmError("no workers are planned yet")

    def release(self, seq_ids, wait=True):
        pass


class CoordinatorServer:
    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.tokenizer = Tokenizer(opts.model)
        ends = load_model_parts(opts.model, with_layers=False)
        self.config = ends.config
        self.engine = Engine(
            ends,
            _NotReady(),
            opts.max_running,
            text_tail=self.tokenizer.decode,
            stop_ids=self.tokenizer.stop_ids,
            limits=Limits(max_queued=opts.max_queued, max_queued_tokens=opts.max_queued_tokens),
        )
        self.metrics = Metrics()
        self.metrics_port = None
        if opts.metrics_port is not None:
            self.metrics_port = self.metrics.serve(opts.metrics_port, opts.host)
        store = None
        if opts.state_dir is not None:
            store = JobStore(Path(opts.state_dir).expanduser() / f"jobs-{opts.cluster}.sqlite")
        self.jobs = JobRegistry(keep_finished=opts.keep_finished, store=store)
        self.loop: EngineLoop | None = None
        self.state = "waiting-for-workers"
        self.entries: list[WorkerEntry] = []
        self.browser: WorkerBrowser | None = None
        self.health = health.HealthServicer()
        self.ready = threading.Event()
        self.failed: str | None = None
        self.heartbeat: Heartbeat | None = None
        self.recovery_problem = ""
        self._stopping = threading.Event()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=64),
            options=[
                ("grpc.max_send_message_length", MESSAGE_LIMIT),
                ("grpc.max_receive_message_length", MESSAGE_LIMIT),
            ],
        )
        servicer = CoordinatorServicer(
            self.engine,
            self.tokenizer,
            self.jobs,
            lambda: self.loop,
            self.cluster_status,
            opts.model.name,
            lambda: self.draining,
        )
        add_service(self.server, servicer, "Coordinator")
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # "" and "liveness": the process answers. "readiness": the model is loaded, the
        # workers are planned, the engine progresses when it has work, and it is not draining.
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.draining = False
        self.port = bind(self.server, f"{opts.host}:{opts.port}", opts.tls)
        if self.port == 0:
            raise WedlmError(f"cannot listen on {opts.host}:{opts.port}")

    def start(self) -> None:
        self.server.start()
        threading.Thread(target=self._assemble, name="planner", daemon=True).start()

    def _assemble(self) -> None:
        opts = self.opts
        try:
            static = parse_static(opts.workers)
            if opts.bonjour:
                loopback = opts.host in ("127.0.0.1", "localhost")
                self.browser = WorkerBrowser(cluster=opts.cluster, loopback_only=loopback)
                self.browser.start()
            found = wait_for_workers(self.browser, static, opts.expect, opts.wait_timeout_s)
            self.state = "planning"
            self.entries = self._plan_with_retries(found)
            links = pipeline_links(self.entries)
            self.engine.use_pipeline(RemotePipeline(links), opts.micro_batches or len(links))
            self._set_kv_budget()
            self.loop = EngineLoop(self.engine, self.tokenizer, self.metrics, self.recover)
            self.loop.start()
            for job in self.jobs.restore():  # accepted before a restart: run them now
                self.loop.submit(job)
            self.heartbeat = Heartbeat(self._current_pipeline)
            self.heartbeat.start()
            self.state = "serving"
            threading.Thread(target=self._watch_readiness, name="readiness", daemon=True).start()
        except Exception as e:  # whatever it was, say so: never "serve" without a pipeline
            self.failed = str(e) or type(e).__name__
            self.state = "failed"
            log.error("%s", self.failed)
        finally:
            self.ready.set()

    def _set_kv_budget(self, headroom: float = 0.8) -> None:
        """KV tokens the tightest worker's measured free memory holds (after its layers),
        keeping 20% for activations and the allocator."""
        budgets = [
            int(e.info.memory_available * headroom) // e.info.kv_bytes_per_token
            for e in self.entries
            if e.health == "serving" and e.info is not None and e.info.kv_bytes_per_token
        ]
        self.engine.scheduler.limits.kv_tokens = min(budgets) if budgets else None
        log.info("KV admission budget: %s tokens", self.engine.scheduler.limits.kv_tokens)

    def ready_now(self, stall_s: float = 30.0) -> bool:
        loop = self.loop
        if self.draining or self.state != "serving" or loop is None:
            return False
        stalled = self.engine.has_work and time.monotonic() - loop.last_progress > stall_s
        return not stalled

    def _watch_readiness(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while not self._stopping.wait(0.5):
            self.health.set("readiness", serving if self.ready_now() else not_serving)

    def drain(self, timeout_s: float) -> int:
        """Stop taking work (UNAVAILABLE), let accepted jobs finish for up to timeout_s,
        then cancel the rest, each with a final message. Returns how many were cancelled."""
        self.draining = True
        self.health.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + timeout_s
        while self.jobs.load()[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.jobs.unfinished()
        for job in left:
            if self.loop is not None:
                self.loop.cancel(job, reason="shutdown")
        for job in left:
            job.wait(5.0)
        return len(left)

    def _plan_with_retries(self, found: list) -> list[WorkerEntry]:
        """Plan and assign; a worker call that fails on the way (one died, or a slow Assign)
        is transient: probe again. A plan that cannot exist (a gap, an overlap) is not."""
        opts = self.opts
        deadline = time.monotonic() + opts.wait_timeout_s
        while True:
            try:
                return assemble(
                    found,
                    self.config,
                    opts.secret,
                    opts.cluster,
                    opts.kv_reserve_tokens,
                    tls=opts.tls,
                )
            except WorkerCallError as e:
                if time.monotonic() > deadline:
                    raise WedlmError(f"planning failed: {e}") from None
                log.warning("planning: %s; probing the workers again", e)
                time.sleep(1.0)
                found = self._candidates() or found

    def _current_pipeline(self) -> RemotePipeline | None:
        pipeline = self.engine.pipeline
        return pipeline if isinstance(pipeline, RemotePipeline) else None

    def _candidates(self) -> list:
        static = parse_static(self.opts.workers)
        found = self.browser.workers() if self.browser is not None else []
        seen = {c.address for c in static}
        return static + [c for c in found if c.address not in seen]

    def recover(self, error: Exception) -> tuple[RemotePipeline, int] | None:
        """Called by the engine thread after losing a worker: re-plan over the workers that
        answer now, retrying until one plan works (a fixed range needs its worker back)."""
        self.state = "recovering"
        old = self._current_pipeline()
        if old is not None:
            old.close()
        deadline = time.monotonic() + self.opts.recovery_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            try:
                entries = assemble(
                    self._candidates(),
                    self.config,
                    self.opts.secret,
                    self.opts.cluster,
                    self.opts.kv_reserve_tokens,
                    probe_timeout_s=2.0,
                )
                links = pipeline_links(entries)
            except (WedlmError, WorkerCallError) as e:
                self.recovery_problem = str(e)
                log.warning("recovery: %s; retrying", e)
                self._stopping.wait(1.0)
                continue
            self.entries = entries
            self._set_kv_budget()
            self.state = "serving"
            self.recovery_problem = ""
            return RemotePipeline(links), self.opts.micro_batches or len(links)
        self.state = "failed"
        return None

    def cluster_status(self) -> pb.ClusterStatusReply:
        reply = pb.ClusterStatusReply(
            cluster=self.opts.cluster,
            state=self.state,
            model_identity=self.config.identity,
            running=len(self.engine.running),
            queued=len(self.engine.waiting),
        )
        for e in self.entries:
            status = reply.workers.add(
                address=e.address, source=e.source, health=e.health, detail=e.detail
            )
            if e.info is not None:
                status.info.CopyFrom(e.info)
            if e.link is not None and e.link.stats.roundtrip_s:
                status.timing.compute_s = statistics.median(e.link.stats.compute_s)
                status.timing.roundtrip_s = statistics.median(e.link.stats.roundtrip_s)
        if self.browser is not None:
            for name, reason in self.browser.rejected():
                reply.workers.add(address=name, source="bonjour", health="rejected", detail=reason)
        return reply

    def stop(self, grace: float = 2.0) -> None:
        self._stopping.set()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.loop is not None:
            self.loop.stop()
        if self.browser is not None:
            self.browser.close()
        for e in self.entries:
            if e.link is not None:
                e.link.close()
        if self.jobs.store is not None:
            self.jobs.store.close()
