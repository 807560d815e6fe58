"""The coordinator's start, on its planner thread: wait for workers until the layers are
covered, plan the pipeline, warm it up and measure its step costs, then start the engine
thread, the heartbeat and the watchers. MLX is used here only before the engine thread
starts; the thread releases its MLX state before it says it is ready."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import mlx.core as mx

from common.errors import WedlmError
from common.layer_runner import RowsError
from common.mlx_thread_exit import release_mlx_thread
from coordinator.cluster.discovery import WorkerBrowser, shortfall
from coordinator.cluster.heartbeat import Heartbeat
from coordinator.cluster.layer_plan import PlanError
from coordinator.cluster.worker_link import WorkerCallError
from coordinator.engine.measured_costs import CostKey
from coordinator.engine.pipeline import StagePipeline
from coordinator.engine.warmup import WarmUpRun, row_buckets, warm_up
from coordinator.service.engine_loop import EngineLoop
from coordinator.service.stage_planner import PlanSettings, StagePlanner

if TYPE_CHECKING:
    from coordinator.service.serve_options import ServeOptions
    from coordinator.service.server import CoordinatorServer

log = logging.getLogger(__name__)
# Row counts warmed before readiness: a single user's. Warming every row bucket first took
# 179 s on gpt-oss-20b's shape on an H200 (172 shapes; RESULTS.md, issue 60): the larger
# batches' shapes now compile while the engine is idle after readiness.
FIRST_WARM_ROWS = 1


def source_address(host: str, port: int) -> str:
    """Where workers reach this coordinator's ModelSource: ":port" when it listens on every
    interface (each worker then uses the address the coordinator's calls come from)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return f":{port}"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def assemble(server: CoordinatorServer) -> None:
    """The planner thread: wait for a plan, then start serving."""
    opts = server.opts
    try:
        if opts.bonjour:
            loopback = opts.host in ("127.0.0.1", "localhost")
            server.browser = WorkerBrowser(cluster=opts.cluster, loopback_only=loopback)
            server.browser.start()
        settings = PlanSettings(
            opts.cluster,
            opts.secret,
            list(opts.workers),
            opts.kv_reserve_tokens,
            opts.micro_batches or 0,
            opts.tls,
            model_source=source_address(opts.host, server.port),
            kv=opts.kv,
            tp=opts.tp,
        )
        server.planner = StagePlanner(settings, server.config, server.local, server.browser)
        pipeline, micro_batches = first_plan(server)
        server.engine.use_pipeline(pipeline, micro_batches)
        server.set_kv_budget()
        warm_up_or_replan(server)
        if server.stopping.is_set():  # stop() came during the plan: start no engine thread
            raise WedlmError("stopped while planning")
        server.loop = EngineLoop(
            server.engine,
            server.tokenizer,
            server.metrics,
            server.recover,
            on_replan=server.resume,
            measure_kv_budget=server.measure_kv_budget,
            idle_work=server.costs if opts.warm_up != "off" else None,
        )
        server.loop.start()
        # this model's jobs accepted before a restart: run them now (one that cannot
        # run on this model fails with why; other models' jobs stay in the store)
        for job in server.jobs.restore():
            server.loop.submit(job)
        server.heartbeat = Heartbeat(server.current_pipeline)
        server.heartbeat.start()
        server.state = "serving"
        server.start_thread(server.watch_readiness, "readiness")
        server.start_thread(server.watch_members, "members")
    except Exception as e:  # whatever it was, say so: never "serve" without a pipeline
        server.failed = str(e) or type(e).__name__
        stopped, server.state = server.stopping.is_set(), "failed"
        log.log(logging.INFO if stopped else logging.ERROR, "%s", server.failed)
    finally:
        release_mlx_thread()
        server.ready.set()


def first_plan(server: CoordinatorServer) -> tuple[StagePipeline, int]:
    """Plan as soon as `--expect` workers are known and the layers can be covered (by
    the coordinator and whoever answers); until then readiness is NOT_SERVING and
    `wedlm status` says what is missing. After --wait-for-workers seconds, give up."""
    opts, planner = server.opts, server.planner
    deadline = time.monotonic() + opts.wait_timeout
    while not server.stopping.is_set():
        found = planner.candidates()
        if len(found) < opts.expect:
            waited = opts.wait_timeout - max(deadline - time.monotonic(), 0)
            problem = shortfall(found, opts.expect, waited, server.browser)
        else:
            server.state = "planning"
            try:
                return planner.build()
            except PlanError as e:
                if e.final:
                    raise
                problem = str(e)
            except (WedlmError, WorkerCallError) as e:
                problem = str(e)
        server.state, server.waiting = "waiting-for-workers", problem
        if time.monotonic() > deadline:
            raise WedlmError(f"no pipeline after waiting {opts.wait_timeout:g} s: {problem}")
        server.stopping.wait(1.0)
    raise WedlmError("stopped while waiting for workers")


def warm_up_pipeline(server: CoordinatorServer) -> None:
    """Before readiness, on the thread that owns MLX (the planner; the engine thread
    after a re-plan): run the bounded shape set once, so that the first users do not
    pay for MLX's kernel compilation (GPUs; MLX's CPU backend compiles nothing per
    shape), then the step costs that must be known before the first request
    (startup_costs.py: reused when measured before, else only what mode auto needs;
    the rest is measured while the engine is idle)."""
    mode = server.opts.warm_up
    if _warms_up(server.opts):
        server.state = "warming-up"
        if server.config.diffusion:
            from coordinator.engine.diffusion.warmup import warm_up_diffusion

            report = warm_up_diffusion(server.engine, max_rows=server.max_running)
        else:
            # what one user reaches first before readiness; the larger batches'
            # shapes while the engine is idle (a first burst compiles what it meets)
            # (`--warm-up on` asks for all of them before readiness)
            first = server.max_running if mode == "on" else FIRST_WARM_ROWS
            log.info("warming up: running each first forward shape once (compiling it)")
            report = warm_up(server.engine, max_rows=first, timing=False)
            rest = [r for r in row_buckets(server.max_running) if r > first]
            server.costs.warm_in_background(WarmUpRun(server.engine, rest))
        server.metrics.forward_shapes.set(server.engine.shapes.count)
        log.info(
            "warmed %d shapes in %.1f s (%d forwards)",
            report.shapes, report.seconds, report.forwards,
        )  # fmt: skip
    if mode != "off" and not server.config.diffusion:
        server.state = "measuring"
        server.costs.prepare()


def warm_up_or_replan(server: CoordinatorServer) -> None:
    """Warm up; a stage lost during it (a worker, a tensor group's process) is lost as
    in serving: plan again over what answers, and serve without the warm-up."""
    try:
        warm_up_pipeline(server)
    except (WedlmError, WorkerCallError, RowsError) as e:
        log.warning("warm-up stopped, a stage was lost: %s; planning again", e)
        result = server.recover(e)
        if result is None:
            raise WedlmError(f"no pipeline after a stage was lost in warm-up: {e}") from e
        server.engine.restart_on(*result)


def cost_key(server: CoordinatorServer) -> CostKey:
    """What the measured step cost depends on (measured_costs.py)."""
    local = server.local
    local_stage = local is not None and local.layer_range is not None
    stages = [f"{len(local.layer_range)} layers here"] if local_stage else []
    stages += [
        f"{len(e.layers)} layers on {e.info.device if e.info is not None else '?'}"
        for e in server.entries
        if e.stage
    ]
    group = local.group if local is not None else None
    if group is not None:  # its own members and links price its forwards
        spec = group.member.spec
        stages.append(f"leads a tensor group of {spec.size} over {spec.backend}")
    return CostKey(
        model=server.config.identity,
        device=server.device,
        stages=tuple(stages),
        micro_batches=server.engine.micro_batches,
        kv=server.opts.kv.label(),
    )


def cost_rows(server: CoordinatorServer) -> list[int]:
    """The row buckets measured in the background: a decode group's where several
    micro-batches overlap (no forward's own time is seen online), every bucket where
    the warm-up ran (GPUs), none otherwise (the engine refines its figures online)."""
    max_running, micro_batches = server.max_running, server.engine.micro_batches
    if micro_batches > 1:
        group = -(-max_running // micro_batches)
        return list(range(1, group + 1))
    return list(range(1, max_running + 1)) if _warms_up(server.opts) else []


def _warms_up(opts: ServeOptions) -> bool:
    """Whether the warm-up runs: `on`, or `auto` on a GPU."""
    return opts.warm_up == "on" or (opts.warm_up == "auto" and mx.default_device() != mx.cpu)
