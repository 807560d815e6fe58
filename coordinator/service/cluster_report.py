"""What the coordinator reports of the cluster: the ClusterStatus reply (`wedlm status`, the
console) and the figures the console shows beside it, read from the server's state."""

from __future__ import annotations

import socket
import statistics
from typing import TYPE_CHECKING

import psutil

from common.proto_gen import wedlm_pb2 as pb
from coordinator.cluster.cluster_setup import LOCAL

if TYPE_CHECKING:
    from coordinator.engine.engine import Engine
    from coordinator.service.server import CoordinatorServer


def _last_ms(values, n: int = 40) -> list[float]:
    """The last n of a deque another thread appends to, in ms."""
    try:
        return [round(v * 1000, 3) for v in list(values)[-n:]]
    except RuntimeError:  # appended to mid-copy: none this time
        return []


def cluster_status(server: CoordinatorServer) -> pb.ClusterStatusReply:
    engine, config, local, planner = server.engine, server.config, server.local, server.planner
    reply = pb.ClusterStatusReply(
        cluster=server.opts.cluster,
        state=server.state,
        model_identity=config.identity,
        running=len(engine.running),
        queued=len(engine.waiting),
        waiting_for=waiting_for(server),
        local_layers=str(local.layer_range or "") if local is not None else "",
        plan_epoch=planner.epoch if planner is not None else 0,
        fetches=server.fetches.snapshot(),
        prefix_cache=prefix_cache_status(engine),
        max_running=server.max_running,
        max_running_reason=server.max_running_reason,
        default_mode=engine.default_mode,
        kv_budget_tokens=engine.limits.kv_tokens or 0,
        limits=pb.RequestLimits(
            max_request_bytes=server.max_request_bytes,
            context_tokens=config.max_position_embeddings,
            max_prompt_chars=server.max_prompt_chars,
        ),
    )
    # the coordinator as a member: what the console shows of it (the same figures)
    me = console_extras(server)["self"]
    fields = pb.CoordinatorMember.DESCRIPTOR.fields_by_name
    reply.coordinator.CopyFrom(pb.CoordinatorMember(**{k: me[k] for k in fields}))
    assembly = planner.assembly if planner is not None else None
    reply.plan_note = assembly.note if assembly is not None else ""
    if assembly is not None and assembly.auto is not None:  # what --tp auto measured
        reply.links.extend(assembly.auto.links)
        reply.read_bandwidth = assembly.auto.reads.get(LOCAL, 0.0)
    for e in server.entries:
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
    if server.browser is not None:
        for name, reason in server.browser.rejected():
            reply.workers.add(address=name, source="bonjour", health="rejected", detail=reason)
    return reply


def console_extras(server: CoordinatorServer) -> dict:
    """What the console shows beside cluster_status (from the HTTP thread; no MLX):
    this machine, each stage's last timings, the memory its heartbeat last reported,
    the stage the heartbeat found gone (before the re-plan), when each lost worker was
    found gone, and the re-plans."""
    timings, memory = {}, {}
    for e in server.entries:
        link = e.link
        if link is None:
            continue
        timings[e.address] = {"compute_ms": _last_ms(link.stats.compute_s),
                              "hop_ms": _last_ms(link.stats.roundtrip_s)}  # fmt: skip
        if (info := link.latest_info) is not None:
            memory[e.address] = (info.memory_total, info.memory_available)
    broken = getattr(server.engine.pipeline, "broken", None)
    available = min(psutil.virtual_memory().available, server.memory_total)
    return {
        "self": {
            "name": socket.gethostname().split(".")[0],
            "address": f"{server.opts.host}:{server.port}",
            "device": server.device,
            "memory_total": server.memory_total,
            "memory_available": available,
        },
        "timings": timings,
        "memory": memory,
        "lost": getattr(broken, "address", "") if broken is not None else "",
        "lost_at": dict(server.lost_at),
        "recoveries": list(server.loop.recovery_log) if server.loop is not None else [],
    }


def prefix_cache_status(engine: Engine) -> pb.PrefixCacheStatus:
    cache = engine.prefix_cache
    if cache is None:
        return pb.PrefixCacheStatus(enabled=False)
    # read from a gRPC thread: entries may change meanwhile, the numbers stay sane
    stats = cache.stats
    return pb.PrefixCacheStatus(
        enabled=True,
        entries=len(cache.entries),
        tokens=max(cache.tokens, 0),
        capacity_tokens=cache.capacity(engine.limits.kv_tokens),
        lookups=stats.lookups,
        hits=stats.hits,
        hit_tokens=stats.hit_tokens,
        evictions=stats.evictions,
        block_tokens=cache.block,
    )


def waiting_for(server: CoordinatorServer) -> str:
    """What the coordinator waits for, in words (empty: nothing)."""
    loop, state = server.loop, server.state
    if loop is not None and loop.dead:
        return f"nothing: the engine thread stopped ({loop.dead}); restart it"
    if state in ("waiting-for-workers", "planning"):
        return server.waiting
    if state == "recovering":
        return server.recovery_problem
    if state == "warming-up":
        return "the warm-up: running each first forward shape once (compiling it)"
    if state == "measuring":
        return "measuring what a forward of several rows costs here (for mode auto)"
    listed = server.planner.waiting_for() if server.planner is not None else ""
    return f"listed workers not in the plan: {listed}" if listed else ""
