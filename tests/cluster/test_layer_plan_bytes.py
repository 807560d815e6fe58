"""Memory planning from each layer's real bytes: a heterogeneous model (DeepSeek's dense
first layer beside its MoE layers) is split by bytes, each worker's range fits its memory;
the sizes come from the checkpoint's safetensors headers (MTP layers neither loaded nor
counted) and each layer's KV per token from mlx-lm's layers (MLA's latent, not heads)."""

from __future__ import annotations

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv_format import FULL, KVFormat
from common.kv_rows import KVRows
from common.layer_range import LayerRange
from common.layer_sizes import estimated_layer_bytes, layer_weight_bytes
from common.model_config import load_model_config
from common.model_parts import load_model_parts, run_layers
from common.proto_gen import wedlm_pb2 as pb
from coordinator.cluster.cluster_setup import WorkerEntry, kv_bytes_per_layer, plan_stages
from coordinator.cluster.layer_plan import PlanError, WorkerCapacity, plan_layers
from tests.support.checkpoints import make_mlx_checkpoint, mlx_lm_greedy

GIB = 1 << 30
DEEPSEEK = [1 * GIB] + [4 * GIB] * 7  # a dense first layer, then MoE layers


def free(*gib: float) -> list[WorkerCapacity]:
    return [WorkerCapacity(f"w{i}", int(g * GIB), None) for i, g in enumerate(gib)]


def range_bytes(plan: dict[str, LayerRange], cost: list[int]) -> dict[str, int]:
    return {k: sum(cost[i] for i in r) for k, r in plan.items()}


def test_a_dense_first_layer_and_moe_layers_split_by_bytes():
    workers = free(16, 16)
    plan = plan_layers(8, workers, DEEPSEEK, 0)
    # by bytes: 13 GiB and 16 GiB, each within its worker's memory
    assert plan == {"w0": LayerRange(0, 3), "w1": LayerRange(4, 7)}
    for w, used in zip(workers, range_bytes(plan, DEEPSEEK).values(), strict=True):
        assert used <= w.available_bytes
    # a bigger first worker takes more MoE layers, still within its memory
    plan = plan_layers(8, free(24, 8), DEEPSEEK, 0)
    assert plan == {"w0": LayerRange(0, 5), "w1": LayerRange(6, 7)}


def test_per_layer_kv_reserve_counts_too():
    kv = [GIB // 2] * 8
    cost = [w + k for w, k in zip(DEEPSEEK, kv, strict=True)]
    workers = free(16, 20)
    plan = plan_layers(8, workers, DEEPSEEK, kv)
    assert plan == {"w0": LayerRange(0, 3), "w1": LayerRange(4, 7)}
    assert range_bytes(plan, cost) == {"w0": 15 * GIB, "w1": 18 * GIB}
    # 33 GiB in 16 + 17: enough in total, but 0-3 leaves 18 GiB and 0-4 takes 19.5
    with pytest.raises(PlanError, match="fit 2 workers in total but not in order"):
        plan_layers(8, free(16, 17), DEEPSEEK, kv)


def test_equal_sizes_given_per_layer_plan_as_one_size():
    for n, memories in ((10, (8, 8, 8)), (36, (32, 16)), (10, (100, 100, 1.2))):
        one = plan_layers(n, free(*memories), GIB, GIB // 10)
        per = plan_layers(n, free(*memories), [GIB] * n, [GIB // 10] * n)
        assert one == per


def test_too_little_memory_names_the_bytes():
    """Counted as eight layers of layer 0's 1 GiB, 24 GiB would look plenty for 29 GiB."""
    with pytest.raises(PlanError) as err:
        plan_layers(8, free(12, 12), DEEPSEEK, 0)
    msg = str(err.value)
    assert "the model's 8 layers do not fit: they need 29.0 GiB" in msg
    assert "29.0 GiB of weights and 0 B of KV reserve; the layers differ in size" in msg
    assert "about 5.0 GiB more memory is missing" in msg
    with pytest.raises(PlanError, match=r"worker w1 has room for no layer: 512\.0 MiB "):
        plan_layers(8, free(64, 0.5), DEEPSEEK, 0)
    with pytest.raises(PlanError, match=r"the smallest layer \(0\) needs 1\.0 GiB"):
        plan_layers(8, free(64, 0.5), DEEPSEEK, 0)


def test_free_workers_fill_a_gap_between_fixed_ranges_by_bytes():
    workers = [WorkerCapacity("A", 0, LayerRange(0, 0)), *free(8, 20)]
    plan = plan_layers(8, workers, DEEPSEEK, 0)
    assert plan == {"A": LayerRange(0, 0), "w0": LayerRange(1, 2), "w1": LayerRange(3, 7)}
    with pytest.raises(PlanError, match="no way to split 2 workers without --layers"):
        plan_layers(8, [WorkerCapacity("A", 0, LayerRange(3, 3)), *free(20, 8)], DEEPSEEK, 0)


def _fits(cost: list[int], memory: list[int]) -> bool:
    """Brute force: some split into one nonempty contiguous run per worker fits."""
    n, k = len(cost), len(memory)
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        if all(
            sum(cost[a:b]) <= m
            for (a, b), m in zip(itertools.pairwise(bounds), memory, strict=True)
        ):
            return True
    return False


@settings(max_examples=300, deadline=None)
@given(
    cost=st.lists(st.integers(1, 40), min_size=1, max_size=9),
    memory=st.lists(st.integers(1, 120), min_size=1, max_size=4),
)
def test_heterogeneous_plans_fit_whenever_a_split_exists(cost, memory):
    if len(set(cost)) == 1:
        cost = [*cost[:-1], cost[-1] + 1]  # the byte path: sizes that differ
    workers = [WorkerCapacity(f"w{i}", m, None) for i, m in enumerate(memory)]
    possible = len(memory) <= len(cost) and _fits(cost, memory)
    try:
        plan = plan_layers(len(cost), workers, cost, 0)
    except PlanError:
        assert not possible
        return
    assert possible
    ranges = list(plan.values())
    assert ranges[0].start == 0 and ranges[-1].end == len(cost) - 1
    for a, b in itertools.pairwise(ranges):
        assert b.start == a.end + 1
    for w in workers:
        assert sum(cost[i] for i in plan[w.key]) <= w.available_bytes


# ---- from a real checkpoint -------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """DeepSeek V3 with 16 experts per MoE layer (the dense first layer is much smaller)
    and one multi-token-prediction layer after its 4 layers, as the hub ships it."""
    path = make_mlx_checkpoint(
        tmp_path_factory.mktemp("hetero") / "ds",
        "deepseek_v3",
        seed=3,
        n_routed_experts=16,
        num_nextn_predict_layers=1,
    )
    tensors = dict(mx.load(str(path / "model.safetensors")))
    mtp = {k.replace("layers.3.", "layers.4.", 1): v for k, v in tensors.items() if ".3." in k}
    mtp["model.layers.4.eh_proj.weight"] = mx.zeros((64, 128))
    mx.save_safetensors(str(path / "model.safetensors"), {**tensors, **mtp}, {"format": "mlx"})
    return path


def test_each_layer_bytes_from_the_headers_mtp_layer_left_out(deepseek):
    config = load_model_config(deepseek)
    sizes = layer_weight_bytes(config)
    assert len(sizes) == 4 and sizes[0] * 3 < sizes[1] == sizes[2] == sizes[3]
    parts = load_model_parts(deepseek)  # the MTP layer's tensors are not loaded
    assert len(parts.layers) == 4
    loaded = [sum(p.nbytes for _, p in _params(layer)) for layer in parts.layers]
    assert loaded == list(sizes)  # float32 as stored: the headers say what loads
    assert estimated_layer_bytes(config, mx.float32) == sum(sizes) // 4


def _params(module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25", "gpt_oss", "gemma4_text"])
def test_kv_bytes_per_token_are_what_the_cache_holds(family, tmp_path):
    """MLA stores its latent and one rope key per token (kv_lora_rank + qk_rope_head_dim),
    not heads x head_dim; Gemma 4's global layers wider heads than its local ones; a
    sliding layer keeps every position here: the planner's bytes equal the engine's own
    KV buffers after a forward."""
    path = make_mlx_checkpoint(tmp_path / family, family, seed=3)
    config = load_model_config(path)
    parts = load_model_parts(path)
    per_layer = FULL.layer_bytes_per_token(config, mx.float32)
    if family in ("deepseek_v3", "kimi_k25"):
        assert per_layer == ((16 + 8) * 4,) * 4
    if family == "gemma4_text":  # 2 KV heads of 16 on local layers, of 32 on global ones
        assert per_layer == (2 * 2 * 16 * 4, 2 * 2 * 32 * 4) * 2
    kv = KVRows(len(parts.layers), 1)
    mx.eval(run_layers(parts, parts.embed(mx.array([[5, 17, 99, 3]])), kv, np.tri(4)[None] > 0))
    assert kv.nbytes() == kv.capacity * sum(per_layer)
    assert FULL.bytes_per_token(config, mx.float32, LayerRange(1, 2)) == sum(per_layer[1:3])
    assert KVFormat(bits=8, group_size=32).bytes_per_token(config, mx.float32, 4) < sum(per_layer)


def test_the_cluster_plan_uses_each_layers_bytes(deepseek):
    """Two workers whose memory holds the dense layer and one MoE layer, and two MoE
    layers: planned from layer 0's size alone the second would get more than fits."""
    config = load_model_config(deepseek)
    sizes = layer_weight_bytes(config)
    kv = kv_bytes_per_layer(config, 64)
    assert kv == ((16 + 8) * 4 * 64,) * 4  # float32 checkpoint, MLA latent per token
    cost = [w + k for w, k in zip(sizes, kv, strict=True)]
    small, big = cost[0] + cost[1] + 100, cost[2] + cost[3] + 100
    entries = [
        WorkerEntry(f"w{i}", "static", "serving", info=pb.WorkerInfo(memory_available=m))
        for i, m in enumerate((small, big))
    ]
    plan = plan_stages(entries, config, 64, local=None)
    assert plan == {"w0": LayerRange(0, 1), "w1": LayerRange(2, 3)}
    assert json.loads((deepseek / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_glm_mtp_layer_is_neither_loaded_nor_counted_and_tokens_stay_mlx_lms(tmp_path):
    """GLM-4.5 ships its multi-token-prediction layer as model.layers.N (N layers): mlx-lm's
    sanitize drops it, and so does this engine's loader and planner; the greedy tokens of
    the checkpoint with it equal mlx-lm's own."""
    from coordinator.engine.local_engine import open_local_engine
    from tests.models.test_mlx_families import MAX_TOKENS, PROMPTS, run

    path = make_mlx_checkpoint(tmp_path / "glm", "glm4_moe", seed=3, num_nextn_predict_layers=1)
    before = layer_weight_bytes(load_model_config(path))
    tensors = dict(mx.load(str(path / "model.safetensors")))
    mtp = {k.replace("layers.3.", "layers.4.", 1): v for k, v in tensors.items() if ".3." in k}
    mtp["model.layers.4.eh_proj.weight"] = mx.zeros((64, 128))
    mx.save_safetensors(str(path / "model.safetensors"), {**tensors, **mtp}, {"format": "mlx"})
    config = load_model_config(path)
    assert layer_weight_bytes(config) == before  # the MTP layer adds no bytes to plan
    local = open_local_engine(path)
    assert len(local.engine.parts.layers) == 4
    prompt = local.tokenizer.encode(PROMPTS[0])
    want = mlx_lm_greedy(path, prompt, MAX_TOKENS, local.engine.model_stop_ids)
    assert run(local, [prompt])[0].output == want and len(set(want)) > 2


def test_a_kv_group_size_is_checked_against_what_the_layers_store(tmp_path):
    """MLA stores rows of kv_lora_rank and qk_rope_head_dim, not head_dim: the group size
    is checked against those; mlx-lm's MLA attention then cannot read quantized rows,
    which the start refuses in one line naming the family."""
    from common.errors import WedlmError
    from common.layer_runner import LayerRunner

    path = make_mlx_checkpoint(
        tmp_path / "ds", "deepseek_v3", seed=3, kv_lora_rank=64, qk_rope_head_dim=32
    )
    config = load_model_config(path)
    KVFormat(bits=8, group_size=32).check(config)  # head_dim 16 alone would refuse 32
    with pytest.raises(WedlmError, match=r"stored widths 32, 64: choose one of 32$"):
        KVFormat(bits=8, group_size=64).check(config)
    with pytest.raises(WedlmError, match="deepseek_v3 cannot keep its KV quantized"):
        LayerRunner(load_model_parts(path), KVFormat(bits=8, group_size=32))
