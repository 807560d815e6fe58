"""`wedlm-coordinator serve`: load the model's ends and tokenizer, start the gRPC service,
plan the pipeline (the coordinator's own layers and the workers that answer), warm it up,
then start the engine thread. Workers may start before or after the coordinator: it waits
until the layers are covered, serves, and takes later workers in by re-planning.
The start's phases are in startup_phases.py, what it reports in cluster_report.py."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import host_info
from common.errors import WedlmError
from common.generation_params import GenerationParams
from common.grpc_services import add_service, enable_reflection
from common.model_parts import load_model_parts
from common.modes import CAUSAL_MODES, DIFFUSION_MODES
from common.proto_gen import wedlm_pb2 as pb
from common.tensor_group.spec import check_tp_flag
from common.tls import bind
from common.tokenizer import Tokenizer
from coordinator.cluster.cluster_setup import WorkerEntry
from coordinator.cluster.discovery import WorkerBrowser
from coordinator.cluster.heartbeat import Heartbeat
from coordinator.cluster.worker_link import WorkerCallError
from coordinator.engine.constrained import Grammars
from coordinator.engine.engine_for import check_draft_model, engine_for
from coordinator.engine.local_layers import LocalLayers
from coordinator.engine.measured_costs import MeasuredCosts
from coordinator.engine.pipeline import StagePipeline
from coordinator.engine.prefix_cache import PrefixCache
from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.http_server import HttpServer
from coordinator.model_source.fetch_progress import FetchProgress
from coordinator.model_source.servicer import ModelSourceServicer
from coordinator.service import cluster_report, kv_budget, startup_phases
from coordinator.service.admission import Admission
from coordinator.service.engine_loop import EngineLoop
from coordinator.service.grpc_server import coordinator_grpc_server
from coordinator.service.job_store import JobStore
from coordinator.service.jobs import JobRegistry
from coordinator.service.metrics import Metrics
from coordinator.service.request_limits import default_max_request_bytes
from coordinator.service.running_limit import AUTO_MAX_RUNNING, auto_max_running
from coordinator.service.serve_options import ServeOptions
from coordinator.service.servicer import CoordinatorServicer
from coordinator.service.stage_planner import StagePlanner
from coordinator.service.startup_costs import StartupCosts

log = logging.getLogger(__name__)
# the modes a request may name, by kind of model (the console's mode selector)
MODES_OF = {"diffusion": DIFFUSION_MODES, "causal": CAUSAL_MODES}
STOP_TIMEOUT_S = 60.0  # for the engine thread's tick in progress, at stop
STARTING_WORDS = {  # each state before readiness, in words (CoordinatorServer.doing)
    "waiting-for-workers": "waiting for the workers to answer",
    "planning": "planning which layers each process holds, and loading them",
    "warming-up": "warming up: running each first forward shape once",
    "measuring": "measuring what a forward of several rows costs here",
}


class _NotReady:
    links = ()
    broken = None

    def submit(self, batch_id, spec, hidden, reply_slots=None):
        raise WedlmError("no workers are planned yet")

    def collect(self):
        raise WedlmError("no workers are planned yet")

    def release(self, seq_ids, wait=True):
        pass


class CoordinatorServer:
    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.tokenizer = Tokenizer(opts.model)
        host_info.wire_model_memory()  # this thread owns MLX until the engine thread starts
        ends = load_model_parts(opts.model, with_layers=False)
        self.config = ends.config
        check_tp_flag(self.config, opts.tp)  # --tp N for a family mlx-lm cannot shard
        self.engine = engine_for(
            ends,
            _NotReady(),
            opts.max_running or AUTO_MAX_RUNNING,  # sized to memory once planned
            text_tail=self.tokenizer.decode,
            stop_ids=self.tokenizer.stop_ids,
            limits=replace(opts.limits),
            prefix_cache=PrefixCache(opts.prefix_cache_tokens) if opts.prefix_cache else None,
        )
        grammars = Grammars(self.tokenizer, self.config.vocab_size, self.engine.model_stop_ids)
        self.engine.use_grammars(grammars)
        if opts.draft_model is not None:
            from coordinator.engine.draft_model import DraftModel

            check_draft_model(ends)
            self.engine.use_drafter(DraftModel.load(opts.draft_model, self.config, self.tokenizer))
        self.metrics = Metrics()
        self.metrics_port = None
        if opts.metrics_port is not None:
            self.metrics_port = self.metrics.serve(opts.metrics_port, opts.host)
        store = None
        if opts.state_dir is not None:  # one store per cluster; each model reads its own jobs
            store = JobStore(
                Path(opts.state_dir).expanduser() / f"jobs-{opts.cluster}.sqlite",
                self.config.identity,
                opts.served_model_name or opts.model.name,
            )
        self.jobs = JobRegistry(keep_finished=opts.keep_finished, store=store)
        self.loop: EngineLoop | None = None
        self.state = "waiting-for-workers"
        self.waiting = ""  # what the first plan waits for
        opts.kv.check(self.config)  # a group size that does not fit the model: refused now
        self.local = LocalLayers(self.config, opts.layers, opts.kv) if opts.local_layers else None
        self.browser: WorkerBrowser | None = None
        self.planner: StagePlanner | None = None
        self.health = health.HealthServicer()
        self.ready = threading.Event()
        self.failed: str | None = None
        self.heartbeat: Heartbeat | None = None
        self.recovery_problem = ""
        self.lost_at: dict[str, float] = {}  # worker address -> when it was found gone
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []  # the planner's and watchers: joined at stop
        self.model_name = opts.served_model_name or opts.model.name
        self.max_running_reason = (
            f"{opts.max_running} (--max-running)" if opts.max_running else "not planned yet"
        )
        context = self.config.max_position_embeddings
        self.max_request_bytes = opts.max_request_bytes or default_max_request_bytes(context)
        log.info(
            "request limits: %s bytes per HTTP body or gRPC request (--max-request-bytes); "
            "prompts of %s tokens (the context), %s characters before tokenizing",
            f"{self.max_request_bytes:,}", f"{context:,}", f"{self.max_prompt_chars:,}",
        )  # fmt: skip
        self.server = coordinator_grpc_server(
            opts.secret, self.config.identity, opts.api_key, self.max_request_bytes
        )
        self.admission = Admission(self.engine, self.jobs, lambda: self.loop, lambda: self.draining)
        servicer = CoordinatorServicer(
            self.engine, self.tokenizer, self.admission, self.cluster_status, self.model_name
        )
        add_service(self.server, servicer, "Coordinator")
        self.fetches = FetchProgress(self.metrics)
        source = ModelSourceServicer(self.config, self.model_name, self.fetches)
        add_service(self.server, source, "ModelSource")
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server)
        # "" and "liveness": the process answers. "readiness": the model is loaded, the
        # workers are planned, the engine progresses when it has work, and it is not draining.
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.draining = False
        self.port = bind(self.server, f"{opts.host}:{opts.port}", opts.tls)
        if self.port == 0:
            raise WedlmError(f"cannot listen on {opts.host}:{opts.port}")
        self.http: HttpServer | None = None
        # this machine, for the console (read here, on the thread that owns MLX for now)
        self.device = host_info.device_description()
        # the step costs (startup_costs.py), kept for the next start in the cache folder
        store = MeasuredCosts(opts.cost_cache)
        self.costs = StartupCosts(
            self.engine,
            partial(startup_phases.cost_key, self),
            partial(startup_phases.cost_rows, self),
            store,
        )
        self.memory_total = host_info.memory()[0]
        if opts.http_port is not None:
            backend = ApiBackend(
                self.admission,
                self.tokenizer,
                self.model_name,
                context,
                self.max_request_bytes,
                opts.default_max_tokens,
                self.ready_now,
                self.metrics,
                opts.api_key,
                alive=self.alive,
                cors_origins=opts.cors_origins,
                cluster_status=self.cluster_status,
                cluster_extras=self.console_extras,
                num_layers=self.config.num_layers,
                modes=MODES_OF["diffusion" if self.config.diffusion else "causal"],
            )
            self.http = HttpServer(backend, opts.host, opts.http_port)

    @property
    def max_prompt_chars(self) -> int:
        """A longer prompt text is refused without tokenizing it."""
        return self.config.max_position_embeddings * self.tokenizer.longest_token_chars

    def start(self) -> None:
        self.server.start()
        if self.http is not None:
            self.http.start()
        self.start_thread(partial(startup_phases.assemble, self), "planner")

    def start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    @property
    def entries(self) -> list[WorkerEntry]:
        assembly = self.planner.assembly if self.planner is not None else None
        return assembly.entries if assembly is not None else []

    def layout(self) -> str:
        assembly = self.planner.assembly if self.planner is not None else None
        return assembly.layout() if assembly is not None else ""

    def resume(self) -> None:
        """After a re-plan, on the engine thread: serve. No warm-up here: it would hold
        every request for its length, and a recovery that fails inside it (out of memory
        again) must not stop the engine; new shapes compile as they come. The step cost
        is measured again while idle, unless this pipeline's was measured before."""
        self.costs.replanned()
        self.state = "serving"

    def watch_members(self, period_s: float = 2.0) -> None:
        """Take in workers that answer after the plan was made (started late, or back
        after a loss): ask the engine thread to re-plan when one would change the plan."""
        while not self.stopping.wait(period_s):
            loop = self.loop
            if loop is None or self.state != "serving" or self.draining:
                continue
            try:
                joined = self.planner.joiners()
            except Exception as e:  # never let the watcher die on one bad probe
                log.warning("membership check failed: %s", e)
                continue
            if joined:
                log.info("%s answered: re-planning to take them in", ", ".join(joined))
                loop.request_replan(f"{', '.join(joined)} joined")

    def measure_kv_budget(self, headroom: float = 0.8) -> int | None:
        """KV tokens the tightest stage's free memory holds now (kv_budget.py)."""
        return kv_budget.measure_kv_budget(
            self.entries, self.local, self.config, self.opts.kv, headroom
        )

    def set_kv_budget(self) -> None:
        """Admission's KV budget from the memory free now; without --max-running, the
        number of sequences decoded at once follows it."""
        engine = self.engine
        engine.change_limits(
            kv_tokens=self.measure_kv_budget(),
            state_tokens=kv_budget.state_tokens(self.config, self.opts.kv),
        )
        limits = engine.limits
        log.info("KV admission budget: %s tokens", limits.kv_tokens)
        if limits.state_tokens:
            log.info("a sequence's recurrent state counts as %s KV tokens", limits.state_tokens)
        if not self.opts.max_running:
            rows = 1 if self.config.default_mode == "ar" else 2 * GenerationParams().window
            rows += limits.state_tokens  # a hybrid family's state, in KV tokens' worth
            max_running, self.max_running_reason = auto_max_running(
                limits.kv_tokens, self.opts.default_max_tokens, rows
            )
            engine.change_limits(max_running=max_running)
        log.info("sequences decoded at once: %s", self.max_running_reason)

    @property
    def max_running(self) -> int:
        return self.engine.limits.max_running

    def alive(self) -> bool:
        """The process can still serve: its engine thread has not stopped on an error."""
        return self.loop is None or self.loop.dead is None

    def ready_now(self, stall_s: float = 30.0) -> bool:
        loop = self.loop
        if self.draining or self.state != "serving" or loop is None or loop.dead:
            return False
        stalled = self.engine.has_work and time.monotonic() - loop.last_progress > stall_s
        return not stalled

    def watch_readiness(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while not self.stopping.wait(0.5):
            self.health.set("readiness", serving if self.ready_now() else not_serving)
            if not self.alive():  # an engine thread that died: restart the process
                self.state = "failed"
                self.health.set("", not_serving)
                self.health.set("liveness", not_serving)

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

    def current_pipeline(self) -> StagePipeline | None:
        pipeline = self.engine.pipeline
        return pipeline if isinstance(pipeline, StagePipeline) and pipeline.links else None

    def recover(self, error: Exception | None) -> tuple[StagePipeline, int] | None:
        """Called by the engine thread after losing a stage (or, with no error, to take in
        a worker that joined): re-plan over the workers that answer now, retrying until
        one plan works (a fixed range may need its worker back)."""
        self.state = "recovering"
        if address := getattr(error, "address", ""):  # the console's "lost N s ago"
            self.lost_at[address] = time.time()
        old = self.engine.pipeline
        if isinstance(old, StagePipeline):
            old.close()
        deadline = time.monotonic() + self.opts.recovery_timeout_s
        while time.monotonic() < deadline and not self.stopping.is_set():
            try:
                pipeline, micro_batches = self.planner.build()
            except (WedlmError, WorkerCallError) as e:
                self.recovery_problem = str(e)
                log.warning("re-planning: %s; retrying", e)
                self.stopping.wait(1.0)
                continue
            self.set_kv_budget()
            self.recovery_problem = ""
            return pipeline, micro_batches
        self.state = "failed"
        return None

    def cluster_status(self) -> pb.ClusterStatusReply:
        return cluster_report.cluster_status(self)

    def console_extras(self) -> dict:
        return cluster_report.console_extras(self)

    def doing(self) -> str:
        """What the coordinator is doing before readiness, in words (the start's log)."""
        return STARTING_WORDS.get(self.state, f"the coordinator is {self.state}")

    def stop(self, grace: float = 2.0, wait_s: float = STOP_TIMEOUT_S) -> bool:
        """Stop serving, then end every thread this server started and wait for them (each
        up to `wait_s`): none may still run MLX or gRPC calls when the interpreter shuts
        down (see release_mlx_thread). The job store is closed last, after the engine
        thread's final records. Returns whether every thread ended (if not, the process
        must leave without the interpreter's shutdown: server_cli)."""
        self.stopping.set()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.health.enter_graceful_shutdown()
        if self.http is not None:
            self.http.stop()
        self.server.stop(grace).wait()
        for thread in self._threads:  # the planner first: it may still start the engine
            thread.join(wait_s)
        for thread in (self.loop, self.heartbeat):  # whichever the planner started
            if thread is not None:
                thread.stop()
                thread.join(wait_s)
        left = [t for t in (*self._threads, self.loop, self.heartbeat) if t and t.is_alive()]
        for thread in left:
            log.error("the %s thread did not stop within %g s", thread.name, wait_s)
        if left:  # it may still run MLX on the pipeline: leave it whole, the process exits
            if self.jobs.store is not None:
                self.jobs.store.close()
            return False
        if self.browser is not None:
            self.browser.close()
        pipeline = self.engine.pipeline
        if isinstance(pipeline, StagePipeline):
            pipeline.close()
        if self.local is not None and self.local.group is not None:
            self.local.group.close()  # its group ends with a word to every member
        if self.jobs.store is not None:
            self.jobs.store.close()
        return True
