"""From candidate workers to a pipeline: verify each candidate (an advertisement is
spoofable, so identity is checked on connect), plan layer ranges, assign the ranges of
workers that have none, and order the links by layer."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from common.checkpoint_weights import layer_nbytes
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.tls import TlsConfig
from coordinator.cluster.discovery import DiscoveredWorker
from coordinator.cluster.layer_plan import PlanError, WorkerCapacity, plan_layers
from coordinator.cluster.worker_link import WorkerCallError, WorkerLink

log = logging.getLogger(__name__)


@dataclass
class WorkerEntry:
    address: str
    source: str
    health: str  # "serving", "unreachable", "rejected", "spare"
    detail: str = ""
    info: pb.WorkerInfo | None = None
    link: WorkerLink | None = None
    layers: LayerRange | None = None


def kv_bytes_per_layer(config: ModelConfig, reserve_tokens: int, dtype_bytes: int) -> int:
    raw = config.raw
    heads = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or config.hidden_size // raw["num_attention_heads"]
    return 2 * heads * head_dim * dtype_bytes * reserve_tokens


def probe(
    cand: DiscoveredWorker,
    config: ModelConfig,
    secret: str | None,
    cluster: str,
    timeout_s: float = 5.0,
    tls: TlsConfig | None = None,
):
    link = WorkerLink(cand.address, secret, config.identity, tls=tls)
    entry = WorkerEntry(cand.address, cand.source, "rejected", link=link)
    try:
        info = link.info(timeout=timeout_s)
    except WorkerCallError as e:
        entry.health = (
            "unreachable" if e.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "rejected"
        )
        entry.detail = str(e)
        return entry
    entry.info = info
    if info.cluster != cluster:
        entry.detail = f"belongs to cluster {info.cluster!r}, not {cluster!r}"
    elif info.model_identity != config.identity:
        entry.detail = f"serves model {info.model_identity}, not {config.identity}"
    elif info.num_layers != config.num_layers:
        entry.detail = f"its model has {info.num_layers} layers, not {config.num_layers}"
    else:
        entry.health = "serving"
        if info.fixed_range:
            entry.layers = LayerRange(info.layer_start, info.layer_end)
    return entry


def assemble(
    candidates: list[DiscoveredWorker],
    config: ModelConfig,
    secret: str | None,
    cluster: str,
    kv_reserve_tokens: int,
    probe_timeout_s: float = 5.0,
    tls: TlsConfig | None = None,
) -> list[WorkerEntry]:
    """Probe, plan and assign. Returns every candidate's entry; the serving ones, in layer
    order, form the pipeline. Raises PlanError when no valid plan exists."""
    entries = [probe(c, config, secret, cluster, probe_timeout_s, tls) for c in candidates]
    usable = [e for e in entries if e.health == "serving"]
    if not usable:
        details = "; ".join(f"{e.address}: {e.detail}" for e in entries) or "none found"
        raise PlanError(f"no usable worker ({details})")
    per_layer = layer_nbytes(config.path)
    dtype_bytes = 2 if str(config.raw.get("torch_dtype", "")).endswith("16") else 4
    plan = plan_layers(
        config.num_layers,
        [WorkerCapacity(e.address, int(e.info.memory_available), e.layers) for e in usable],
        per_layer,
        kv_bytes_per_layer(config, kv_reserve_tokens, dtype_bytes),
    )
    todo = []
    for e in usable:
        if e.address not in plan:
            e.health = "spare"
            continue
        e.layers = plan[e.address]
        current = LayerRange(e.info.layer_start, e.info.layer_end) if e.info.has_layers else None
        if current != e.layers:
            todo.append(e)
    if todo:  # workers load their ranges at the same time
        with ThreadPoolExecutor(len(todo)) as pool:
            for e, info in zip(todo, pool.map(_assign, todo), strict=True):
                e.info = info
    return sorted(entries, key=lambda e: (e.layers.start if e.layers else 1 << 30, e.address))


def _assign(entry: WorkerEntry) -> pb.WorkerInfo:
    log.info("assigning layers %s to %s", entry.layers, entry.address)
    return entry.link.assign(entry.layers.start, entry.layers.end)


def _room(entry: WorkerEntry, per_layer: int) -> int:
    """Memory a worker could give: what is free plus what its current layers occupy (an
    unfixed worker drops them when it is assigned a new range)."""
    info = entry.info
    held = info.layer_end - info.layer_start + 1 if info.has_layers and not info.fixed_range else 0
    return int(info.memory_available) + held * per_layer


def pipeline_links(entries: list[WorkerEntry]) -> list[WorkerLink]:
    return [e.link for e in entries if e.health == "serving" and e.layers is not None]
