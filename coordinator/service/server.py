"""`wedlm-coordinator serve`: load the model's ends and tokenizer, start the gRPC service,
plan the pipeline (the coordinator's own layers and the workers that answer), warm it up,
then start the engine thread. Workers may start before or after the coordinator: it waits
until the layers are covered, serves, and takes later workers in by re-planning."""

from __future__ import annotations

import logging
import socket
import statistics
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import mlx.core as mx
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import host_info
from common.call_auth import ClusterAuthInterceptor
from common.errors import WedlmError
from common.generation_params import GenerationParams
from common.grpc_services import (
    MESSAGE_LIMIT,
    SERVER_PING_POLICY,
    add_service,
    enable_reflection,
)
from common.kv_format import KVFormat
from common.layer_runner import RowsError
from common.layer_sizes import compute_dtype, kv_bytes_per_token
from common.mlx_thread_exit import release_mlx_thread
from common.model_parts import load_model_parts
from common.modes import CAUSAL_MODES, DIFFUSION_MODES
from common.proto_gen import wedlm_pb2 as pb
from common.recurrent_rows import model_state_bytes
from common.tensor_group.spec import check_tp_flag
from common.tls import TlsConfig, bind, load_tls
from common.tokenizer import Tokenizer
from coordinator.cluster.cluster_setup import LOCAL, WorkerEntry
from coordinator.cluster.discovery import WorkerBrowser, shortfall
from coordinator.cluster.heartbeat import Heartbeat
from coordinator.cluster.layer_plan import PlanError
from coordinator.cluster.worker_link import WorkerCallError
from coordinator.engine.constrained import Grammars
from coordinator.engine.engine import Limits
from coordinator.engine.engine_for import check_draft_model, engine_for
from coordinator.engine.local_layers import LocalLayers
from coordinator.engine.measured_costs import CostKey, MeasuredCosts
from coordinator.engine.pipeline import StagePipeline
from coordinator.engine.prefix_cache import PrefixCache
from coordinator.engine.warmup import WarmUpRun, row_buckets, warm_up
from coordinator.http_api.api_backend import ApiBackend
from coordinator.http_api.http_server import HttpServer
from coordinator.model_source.fetch_progress import FetchProgress
from coordinator.model_source.servicer import ModelSourceServicer
from coordinator.service.admission import Admission
from coordinator.service.api_key import ApiKeyInterceptor
from coordinator.service.engine_loop import EngineLoop
from coordinator.service.job_store import JobStore
from coordinator.service.jobs import JobRegistry
from coordinator.service.metrics import Metrics
from coordinator.service.request_limits import default_max_request_bytes
from coordinator.service.running_limit import AUTO_MAX_RUNNING, auto_max_running
from coordinator.service.serve_settings import ServeSettings
from coordinator.service.servicer import CoordinatorServicer
from coordinator.service.stage_planner import PlanSettings, StagePlanner
from coordinator.service.startup_costs import StartupCosts

log = logging.getLogger(__name__)
# Row counts warmed before readiness: a single user's. Warming every row bucket first took
# 179 s on gpt-oss-20b's shape on an H200 (172 shapes; RESULTS.md, issue 60): the larger
# batches' shapes now compile while the engine is idle after readiness.
FIRST_WARM_ROWS = 1
MODEL_SOURCE = "/wedlm.v1.ModelSource/"
# the modes a request may name, by kind of model (the console's mode selector)
MODES_OF = {"diffusion": DIFFUSION_MODES, "causal": CAUSAL_MODES}
STOP_TIMEOUT_S = 60.0  # for the engine thread's tick in progress, at stop
STARTING_WORDS = {  # each state before readiness, in words (CoordinatorServer.doing)
    "waiting-for-workers": "waiting for the workers to answer",
    "planning": "planning which layers each process holds, and loading them",
    "warming-up": "warming up: running each first forward shape once",
    "measuring": "measuring what a forward of several rows costs here",
}


def _last_ms(values, n: int = 40) -> list[float]:
    """The last n of a deque another thread appends to, in ms."""
    try:
        return [round(v * 1000, 3) for v in list(values)[-n:]]
    except RuntimeError:  # appended to mid-copy: none this time
        return []


def source_address(host: str, port: int) -> str:
    """Where workers reach this coordinator's ModelSource: ":port" when it listens on every
    interface (each worker then uses the address the coordinator's calls come from)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return f":{port}"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass
class ServeOptions(ServeSettings):
    """What the server runs with: every setting is a field of ServeSettings (declared once,
    with its flag, TOML key and default), filled from the flags and the TOML file by
    serve_args.py. Declared here: the settings' resolved forms and what only code sets."""

    model: Path  # the model's folder (the setting's folder or hub id, resolved)
    draft_model: Path | None = None  # its folder (resolved like the model's)
    limits: Limits = field(default_factory=Limits)  # the queue and prefill settings
    recovery_timeout_s: float = 600.0  # how long to wait for workers after a loss
    cost_cache: Path | None = None  # the measured step costs' file (None: the cache folder)
    # made from the settings (__post_init__): how every stage stores KV, the TLS files read
    kv: KVFormat = field(init=False)
    tls: TlsConfig = field(init=False)  # serves clients, dials workers

    def __post_init__(self) -> None:
        self.kv = KVFormat(self.kv_bits, self.kv_group_size)
        self.tls = load_tls(self.tls_cert, self.tls_key, self.tls_ca)
        self.api_key = self.api_key or None  # an empty $WEDLM_API_KEY: no key
        self.cors_origins = tuple(self.cors_origins or ())  # what ApiBackend keeps


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
        self._stopping = threading.Event()
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
        # Workers' fetches carry the cluster's credentials; clients' calls the API key.
        interceptors = [
            ClusterAuthInterceptor(
                opts.secret, self.config.identity, guarded=(MODEL_SOURCE,), role="coordinator"
            )
        ]
        if opts.api_key:
            interceptors.append(ApiKeyInterceptor(opts.api_key, open_prefixes=(MODEL_SOURCE,)))
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=64),
            options=[
                ("grpc.max_send_message_length", MESSAGE_LIMIT),  # layer files, to workers
                # What this server receives is small: clients' requests, and workers' fetch
                # requests and health checks (hidden states travel on the channels it
                # dials, with their own 256 MB limit). A larger message is refused before
                # it is read whole, with RESOURCE_EXHAUSTED naming the limit.
                ("grpc.max_receive_message_length", self.max_request_bytes),
                *SERVER_PING_POLICY,  # workers' fetch channels ping every 10 s
            ],
            interceptors=interceptors,
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
        self.costs = StartupCosts(self.engine, self._cost_key, self._cost_rows, store)
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
        self._start_thread(self._assemble, "planner")

    def _start_thread(self, target, name: str) -> None:
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

    def _assemble(self) -> None:
        """The planner thread: wait for a plan, then start serving (MLX is used here only
        before the engine thread starts; the thread releases its MLX state before it says
        it is ready)."""
        opts = self.opts
        try:
            if opts.bonjour:
                loopback = opts.host in ("127.0.0.1", "localhost")
                self.browser = WorkerBrowser(cluster=opts.cluster, loopback_only=loopback)
                self.browser.start()
            settings = PlanSettings(
                opts.cluster,
                opts.secret,
                list(opts.workers),
                opts.kv_reserve_tokens,
                opts.micro_batches or 0,
                opts.tls,
                model_source=source_address(opts.host, self.port),
                kv=opts.kv,
                tp=opts.tp,
            )
            self.planner = StagePlanner(settings, self.config, self.local, self.browser)
            pipeline, micro_batches = self._first_plan()
            self.engine.use_pipeline(pipeline, micro_batches)
            self._set_kv_budget()
            self._warm_up_or_replan()
            if self._stopping.is_set():  # stop() came during the plan: start no engine thread
                raise WedlmError("stopped while planning")
            self.loop = EngineLoop(
                self.engine,
                self.tokenizer,
                self.metrics,
                self.recover,
                on_replan=self._resume,
                measure_kv_budget=self.measure_kv_budget,
                idle_work=self.costs if self.opts.warm_up != "off" else None,
            )
            self.loop.start()
            # this model's jobs accepted before a restart: run them now (one that cannot
            # run on this model fails with why; other models' jobs stay in the store)
            for job in self.jobs.restore():
                self.loop.submit(job)
            self.heartbeat = Heartbeat(self._current_pipeline)
            self.heartbeat.start()
            self.state = "serving"
            self._start_thread(self._watch_readiness, "readiness")
            self._start_thread(self._watch_members, "members")
        except Exception as e:  # whatever it was, say so: never "serve" without a pipeline
            self.failed = str(e) or type(e).__name__
            stopped, self.state = self._stopping.is_set(), "failed"
            log.log(logging.INFO if stopped else logging.ERROR, "%s", self.failed)
        finally:
            release_mlx_thread()
            self.ready.set()

    def _first_plan(self) -> tuple[StagePipeline, int]:
        """Plan as soon as `--expect` workers are known and the layers can be covered (by
        the coordinator and whoever answers); until then readiness is NOT_SERVING and
        `wedlm status` says what is missing. After --wait-for-workers seconds, give up."""
        opts, planner = self.opts, self.planner
        deadline = time.monotonic() + opts.wait_timeout
        while not self._stopping.is_set():
            found = planner.candidates()
            if len(found) < opts.expect:
                waited = opts.wait_timeout - max(deadline - time.monotonic(), 0)
                problem = shortfall(found, opts.expect, waited, self.browser)
            else:
                self.state = "planning"
                try:
                    return planner.build()
                except PlanError as e:
                    if e.final:
                        raise
                    problem = str(e)
                except (WedlmError, WorkerCallError) as e:
                    problem = str(e)
            self.state, self.waiting = "waiting-for-workers", problem
            if time.monotonic() > deadline:
                raise WedlmError(f"no pipeline after waiting {opts.wait_timeout:g} s: {problem}")
            self._stopping.wait(1.0)
        raise WedlmError("stopped while waiting for workers")

    def warm_up(self) -> None:
        """Before readiness, on the thread that owns MLX (the planner; the engine thread
        after a re-plan): run the bounded shape set once, so that the first users do not
        pay for MLX's kernel compilation (GPUs; MLX's CPU backend compiles nothing per
        shape), then the step costs that must be known before the first request
        (startup_costs.py: reused when measured before, else only what mode auto needs;
        the rest is measured while the engine is idle)."""
        mode = self.opts.warm_up
        if mode == "on" or (mode == "auto" and mx.default_device() != mx.cpu):
            self.state = "warming-up"
            if self.config.diffusion:
                from coordinator.engine.diffusion.warmup import warm_up_diffusion

                report = warm_up_diffusion(self.engine, max_rows=self.max_running)
            else:
                # what one user reaches first before readiness; the larger batches'
                # shapes while the engine is idle (a first burst compiles what it meets)
                # (`--warm-up on` asks for all of them before readiness)
                first = self.max_running if mode == "on" else FIRST_WARM_ROWS
                log.info("warming up: running each first forward shape once (compiling it)")
                report = warm_up(self.engine, max_rows=first, timing=False)
                rest = [r for r in row_buckets(self.max_running) if r > first]
                self.costs.warm_in_background(WarmUpRun(self.engine, rest))
            self.metrics.forward_shapes.set(self.engine.shapes.count)
            log.info(
                "warmed %d shapes in %.1f s (%d forwards)",
                report.shapes, report.seconds, report.forwards,
            )  # fmt: skip
        if mode != "off" and not self.config.diffusion:
            self.state = "measuring"
            self.costs.prepare()

    def _cost_key(self) -> CostKey:
        """What the measured step cost depends on (measured_costs.py)."""
        stages = [f"{len(self.local.layer_range)} layers here"] if self._local_stage() else []
        stages += [
            f"{len(e.layers)} layers on {e.info.device if e.info is not None else '?'}"
            for e in self.entries
            if e.stage
        ]
        group = self.local.group if self.local is not None else None
        if group is not None:  # its own members and links price its forwards
            spec = group.member.spec
            stages.append(f"leads a tensor group of {spec.size} over {spec.backend}")
        return CostKey(
            model=self.config.identity,
            device=self.device,
            stages=tuple(stages),
            micro_batches=self.engine.micro_batches,
            kv=self.opts.kv.label(),
        )

    def _local_stage(self) -> bool:
        return self.local is not None and self.local.layer_range is not None

    def _cost_rows(self) -> list[int]:
        """The row buckets measured in the background: a decode group's where several
        micro-batches overlap (no forward's own time is seen online), every bucket where
        the warm-up ran (GPUs), none otherwise (the engine refines its figures online)."""
        if self.engine.micro_batches > 1:
            group = -(-self.max_running // self.engine.micro_batches)
            return list(range(1, group + 1))
        warmed = self.opts.warm_up == "on" or (
            self.opts.warm_up == "auto" and mx.default_device() != mx.cpu
        )
        return list(range(1, self.max_running + 1)) if warmed else []

    def _warm_up_or_replan(self) -> None:
        """Warm up; a stage lost during it (a worker, a tensor group's process) is lost as
        in serving: plan again over what answers, and serve without the warm-up."""
        try:
            self.warm_up()
        except (WedlmError, WorkerCallError, RowsError) as e:
            log.warning("warm-up stopped, a stage was lost: %s; planning again", e)
            result = self.recover(e)
            if result is None:
                raise WedlmError(f"no pipeline after a stage was lost in warm-up: {e}") from e
            self.engine.restart_on(*result)

    def _resume(self) -> None:
        """After a re-plan, on the engine thread: serve. No warm-up here: it would hold
        every request for its length, and a recovery that fails inside it (out of memory
        again) must not stop the engine; new shapes compile as they come. The step cost
        is measured again while idle, unless this pipeline's was measured before."""
        self.costs.replanned()
        self.state = "serving"

    def _watch_members(self, period_s: float = 2.0) -> None:
        """Take in workers that answer after the plan was made (started late, or back
        after a loss): ask the engine thread to re-plan when one would change the plan."""
        while not self._stopping.wait(period_s):
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
        """KV tokens the tightest stage's measured free memory holds (after its layers),
        keeping 20% for activations and the allocator. Free memory is what the system
        says is free now (host_info.memory: on a Mac unified memory the OS and other apps
        leave, on CUDA the device's own), so other processes' use counts."""
        budgets = [
            int(e.info.memory_available * headroom) // e.info.kv_bytes_per_token
            for e in self.entries
            if e.health == "serving" and e.info is not None and e.info.kv_bytes_per_token
        ]
        held = self.local.layer_range if self.local is not None else None
        if held is not None:
            dtype = compute_dtype(self.config)
            per_token = kv_bytes_per_token(self.config, dtype, held, self.opts.kv)
            if self.local.group is not None:  # rank 0 of a group keeps its heads' share
                per_token = self.local.group.member.ready["kv_bytes_per_token"]
            if per_token:  # layers of recurrent state alone keep no KV per token
                budgets.append(int(host_info.memory()[1] * headroom) // per_token)
        return min(budgets) if budgets else None

    def _state_tokens(self) -> int:
        """A sequence's recurrent state (hybrid families) in KV tokens' worth of memory,
        the model's whole state against its whole KV per token (0: attention only)."""
        dtype = compute_dtype(self.config)
        state = model_state_bytes(self.config, dtype)
        per_token = kv_bytes_per_token(self.config, dtype, self.config.num_layers, self.opts.kv)
        return -(-state // per_token) if state and per_token else 0

    def _set_kv_budget(self) -> None:
        """Admission's KV budget from the memory free now; without --max-running, the
        number of sequences decoded at once follows it."""
        limits = self.engine.scheduler.limits
        limits.kv_tokens = self.measure_kv_budget()
        limits.state_tokens = self._state_tokens()
        log.info("KV admission budget: %s tokens", limits.kv_tokens)
        if limits.state_tokens:
            log.info("a sequence's recurrent state counts as %s KV tokens", limits.state_tokens)
        if not self.opts.max_running:
            rows = 1 if self.config.default_mode == "ar" else 2 * GenerationParams().window
            rows += limits.state_tokens  # a hybrid family's state, in KV tokens' worth
            limits.max_running, self.max_running_reason = auto_max_running(
                limits.kv_tokens, self.opts.default_max_tokens, rows
            )
        log.info("sequences decoded at once: %s", self.max_running_reason)

    @property
    def max_running(self) -> int:
        return self.engine.scheduler.limits.max_running

    def alive(self) -> bool:
        """The process can still serve: its engine thread has not stopped on an error."""
        return self.loop is None or self.loop.dead is None

    def ready_now(self, stall_s: float = 30.0) -> bool:
        loop = self.loop
        if self.draining or self.state != "serving" or loop is None or loop.dead:
            return False
        stalled = self.engine.has_work and time.monotonic() - loop.last_progress > stall_s
        return not stalled

    def _watch_readiness(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while not self._stopping.wait(0.5):
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

    def _current_pipeline(self) -> StagePipeline | None:
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
        while time.monotonic() < deadline and not self._stopping.is_set():
            try:
                pipeline, micro_batches = self.planner.build()
            except (WedlmError, WorkerCallError) as e:
                self.recovery_problem = str(e)
                log.warning("re-planning: %s; retrying", e)
                self._stopping.wait(1.0)
                continue
            self._set_kv_budget()
            self.recovery_problem = ""
            return pipeline, micro_batches
        self.state = "failed"
        return None

    def cluster_status(self) -> pb.ClusterStatusReply:
        reply = pb.ClusterStatusReply(
            cluster=self.opts.cluster,
            state=self.state,
            model_identity=self.config.identity,
            running=len(self.engine.running),
            queued=len(self.engine.waiting),
            waiting_for=self._waiting_for(),
            local_layers=str(self.local.layer_range or "") if self.local is not None else "",
            plan_epoch=self.planner.epoch if self.planner is not None else 0,
            fetches=self.fetches.snapshot(),
            prefix_cache=self._prefix_cache_status(),
            max_running=self.max_running,
            max_running_reason=self.max_running_reason,
            default_mode=self.engine.default_mode,
            kv_budget_tokens=self.engine.scheduler.limits.kv_tokens or 0,
            limits=pb.RequestLimits(
                max_request_bytes=self.max_request_bytes,
                context_tokens=self.config.max_position_embeddings,
                max_prompt_chars=self.max_prompt_chars,
            ),
        )
        # the coordinator as a member: what the console shows of it (the same figures)
        me = self.console_extras()["self"]
        fields = pb.CoordinatorMember.DESCRIPTOR.fields_by_name
        reply.coordinator.CopyFrom(pb.CoordinatorMember(**{k: me[k] for k in fields}))
        assembly = self.planner.assembly if self.planner is not None else None
        reply.plan_note = assembly.note if assembly is not None else ""
        if assembly is not None and assembly.auto is not None:  # what --tp auto measured
            reply.links.extend(assembly.auto.links)
            reply.read_bandwidth = assembly.auto.reads.get(LOCAL, 0.0)
        for e in self.entries:
            status = reply.workers.add(
                address=e.address, source=e.source, health=e.health, detail=e.detail,
                group_leader=e.group.leader.address if e.group is not None else "",
            )  # fmt: skip
            if e.info is not None:
                status.info.CopyFrom(e.info)
            if e.link is not None and (beat := e.link.latest_info) is not None:
                # memory now, as the console shows it (e.info is from the plan's Assign)
                status.info.memory_total = beat.memory_total
                status.info.memory_available = beat.memory_available
            if e.link is not None and e.link.stats.roundtrip_s:
                status.timing.compute_s = statistics.median(e.link.stats.compute_s)
                status.timing.roundtrip_s = statistics.median(e.link.stats.roundtrip_s)
        if self.browser is not None:
            for name, reason in self.browser.rejected():
                reply.workers.add(address=name, source="bonjour", health="rejected", detail=reason)
        return reply

    def console_extras(self) -> dict:
        """What the console shows beside cluster_status (from the HTTP thread; no MLX):
        this machine, each stage's last timings, the memory its heartbeat last reported,
        the stage the heartbeat found gone (before the re-plan), when each lost worker was
        found gone, and the re-plans."""
        timings, memory = {}, {}
        for e in self.entries:
            link = e.link
            if link is None:
                continue
            timings[e.address] = {"compute_ms": _last_ms(link.stats.compute_s),
                                  "hop_ms": _last_ms(link.stats.roundtrip_s)}  # fmt: skip
            if (info := link.latest_info) is not None:
                memory[e.address] = (info.memory_total, info.memory_available)
        broken = getattr(self.engine.pipeline, "broken", None)
        available = min(psutil.virtual_memory().available, self.memory_total)
        return {
            "self": {
                "name": socket.gethostname().split(".")[0],
                "address": f"{self.opts.host}:{self.port}",
                "device": self.device,
                "memory_total": self.memory_total,
                "memory_available": available,
            },
            "timings": timings,
            "memory": memory,
            "lost": getattr(broken, "address", "") if broken is not None else "",
            "lost_at": dict(self.lost_at),
            "recoveries": list(self.loop.recovery_log) if self.loop is not None else [],
        }

    def _prefix_cache_status(self) -> pb.PrefixCacheStatus:
        cache = self.engine.prefix_cache
        if cache is None:
            return pb.PrefixCacheStatus(enabled=False)
        # read from a gRPC thread: entries may change meanwhile, the numbers stay sane
        stats = cache.stats
        return pb.PrefixCacheStatus(
            enabled=True,
            entries=len(cache.entries),
            tokens=max(cache.tokens, 0),
            capacity_tokens=cache.capacity(self.engine.scheduler.limits.kv_tokens),
            lookups=stats.lookups,
            hits=stats.hits,
            hit_tokens=stats.hit_tokens,
            evictions=stats.evictions,
            block_tokens=cache.block,
        )

    def doing(self) -> str:
        """What the coordinator is doing before readiness, in words (the start's log)."""
        return STARTING_WORDS.get(self.state, f"the coordinator is {self.state}")

    def _waiting_for(self) -> str:
        if self.loop is not None and self.loop.dead:
            return f"nothing: the engine thread stopped ({self.loop.dead}); restart it"
        if self.state in ("waiting-for-workers", "planning"):
            return self.waiting
        if self.state == "recovering":
            return self.recovery_problem
        if self.state == "warming-up":
            return "the warm-up: running each first forward shape once (compiling it)"
        if self.state == "measuring":
            return "measuring what a forward of several rows costs here (for mode auto)"
        listed = self.planner.waiting_for() if self.planner is not None else ""
        return f"listed workers not in the plan: {listed}" if listed else ""

    def stop(self, grace: float = 2.0, wait_s: float = STOP_TIMEOUT_S) -> bool:
        """Stop serving, then end every thread this server started and wait for them (each
        up to `wait_s`): none may still run MLX or gRPC calls when the interpreter shuts
        down (see release_mlx_thread). The job store is closed last, after the engine
        thread's final records. Returns whether every thread ended (if not, the process
        must leave without the interpreter's shutdown: server_cli)."""
        self._stopping.set()
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
