"""How many KV tokens admission may promise: the tightest stage's free memory after its
layers, and a hybrid family's recurrent state counted in KV tokens' worth."""

from __future__ import annotations

from common import host_info
from common.kv_format import KVFormat
from common.layer_sizes import compute_dtype, kv_bytes_per_token
from common.model_config import ModelConfig
from common.recurrent_rows import model_state_bytes
from coordinator.cluster.cluster_setup import WorkerEntry
from coordinator.engine.local_layers import LocalLayers


def measure_kv_budget(
    entries: list[WorkerEntry],
    local: LocalLayers | None,
    config: ModelConfig,
    kv: KVFormat,
    headroom: float = 0.8,
) -> int | None:
    """KV tokens the tightest stage's measured free memory holds (after its layers),
    keeping 20% for activations and the allocator. Free memory is what the system
    says is free now (host_info.memory: on a Mac unified memory the OS and other apps
    leave, on CUDA the device's own), so other processes' use counts."""
    budgets = [
        int(e.info.memory_available * headroom) // e.info.kv_bytes_per_token
        for e in entries
        if e.health == "serving" and e.info is not None and e.info.kv_bytes_per_token
    ]
    held = local.layer_range if local is not None else None
    if held is not None:
        dtype = compute_dtype(config)
        per_token = kv_bytes_per_token(config, dtype, held, kv)
        if local.group is not None:  # rank 0 of a group keeps its heads' share
            per_token = local.group.member.ready["kv_bytes_per_token"]
        if per_token:  # layers of recurrent state alone keep no KV per token
            budgets.append(int(host_info.memory()[1] * headroom) // per_token)
    return min(budgets) if budgets else None


def state_tokens(config: ModelConfig, kv: KVFormat) -> int:
    """A sequence's recurrent state (hybrid families) in KV tokens' worth of memory,
    the model's whole state against its whole KV per token (0: attention only)."""
    dtype = compute_dtype(config)
    state = model_state_bytes(config, dtype)
    per_token = kv_bytes_per_token(config, dtype, config.num_layers, kv)
    return -(-state // per_token) if state and per_token else 0
