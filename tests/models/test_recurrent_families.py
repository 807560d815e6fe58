"""Hybrid families whose layers keep recurrent state (Qwen3-Next's and Qwen3.5's gated
delta-rule linear attention, dense and MoE; LFM2's short convolutions; Nemotron-H's
Mamba-2), served by the single-process engine:
greedy AR tokens equal mlx-lm's own `generate_step` (float32), alone, batched with a
prompt of another length (a ragged prefill: padding must not enter a state), and from the
prefix cache, which forks a state only at an entry's whole length. Modes that write rows
and take some back (WeDLM, speculative) are refused by name; mode auto decodes with AR."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.generation_params import GenerationParams
from common.model_families import KV, NO_CACHE, LayerCache
from common.model_parts import load_model_parts
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.prefix_cache import PrefixCache
from tests.support.checkpoints import WEDLM_RECORD, make_mlx_checkpoint, mlx_lm_greedy

SMALL = {"num_hidden_layers": 4, "head_dim": 16}
LINEAR = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}
# model_type -> make_mlx_checkpoint's spec: (architecture, config fields, tied head)
SPECS = {
    # linear-attention layers between full-attention ones, MoE with a shared expert
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        {
            **SMALL,
            **LINEAR,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 32,
            "mlp_only_layers": [],
            "moe_intermediate_size": 32,
            "partial_rotary_factor": 0.5,
        },
        False,
    ),
    # Qwen3.5's multimodal layout: the text model (qwen3_5_text) under text_config
    "qwen3_5": (
        "Qwen3_5ForConditionalGeneration",
        {"text_config": {**SMALL, **LINEAR, "model_type": "qwen3_5_text"}},
        False,
    ),
    # Qwen3.5's MoE text model (routed experts and a shared one) in the same layout
    "qwen3_5_moe": (
        "Qwen3_5MoeForConditionalGeneration",
        {
            "text_config": {
                **SMALL,
                **LINEAR,
                "model_type": "qwen3_5_moe_text",
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "shared_expert_intermediate_size": 32,
                "moe_intermediate_size": 32,
            }
        },
        False,
    ),
    # LFM2: short gated convolutions (a state of one array) between attention layers
    "lfm2": (
        "Lfm2ForCausalLM",
        {
            **SMALL,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": 64,
            "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "layer_types": ["conv", "full_attention"] * 2,
        },
        True,
    ),
    # Mamba-2 layers (M), attention (*) and an MLP layer (-) that takes no cache
    "nemotron_h": (
        "NemotronHForCausalLM",
        {
            **SMALL,
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": "M*M-",
        },
        False,
    ),
}
FAMILIES = list(SPECS)
STATE = LayerCache(state=2)  # a layer of two state arrays (conv window, SSM/delta state)
KINDS = {
    "qwen3_next": (STATE, KV, STATE, KV),
    "qwen3_5": (STATE, KV, STATE, KV),
    "qwen3_5_moe": (STATE, KV, STATE, KV),
    "lfm2": (LayerCache(state=1), KV, LayerCache(state=1), KV),
    "nemotron_h": (STATE, KV, STATE, NO_CACHE),
}
PROMPTS = (
    "once upon a time there was a little robot who liked to count",
    "the quick brown fox",
)
MAX_TOKENS = 16
AR = GenerationParams(mode="ar", max_tokens=MAX_TOKENS)


def make(root: Path, family: str) -> Path:
    return make_mlx_checkpoint(root / family, family, seed=3, spec=SPECS[family])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recurrent-families")
    return {f: make(root, f) for f in FAMILIES}


_ENGINES: dict = {}


def engine(path: Path, rows: int = 1, cached: bool = False):
    key = (str(path), rows, cached)
    if key not in _ENGINES:
        cache = PrefixCache(capacity_tokens=100_000) if cached else None
        _ENGINES[key] = open_local_engine(path, num_rows=rows, prefix_cache=cache)
    return _ENGINES[key]


def reference(path: Path, prompt: list[int]) -> list[int]:
    return mlx_lm_greedy(path, prompt, MAX_TOKENS, engine(path).engine.config.eos_token_ids)


def run(local, prompts: list[list[int]]):
    seqs = [local.engine.submit(p, AR) for p in prompts]
    for _ in local.engine.stream(seqs):
        pass
    return seqs


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_matches_mlx_lm(models, family):
    path = models[family]
    local = engine(path)
    assert local.engine.parts.caches == KINDS[family]
    for text in PROMPTS:
        prompt = local.tokenizer.encode(text)
        want = reference(path, prompt)
        assert len(set(want)) > 2, "degenerate random model: the test would prove little"
        assert run(local, [prompt])[0].output == want, text


@pytest.mark.parametrize("family", FAMILIES)
def test_two_prompts_batched_give_each_its_solo_tokens(models, family):
    """The two prompts (12 and 4 tokens) are prefilled in one forward: the short one's
    padding is masked out of its state, as mlx-lm's `lengths` mask does."""
    path = models[family]
    local = engine(path, rows=2)
    prompts = [local.tokenizer.encode(t) for t in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])
    seqs = run(local, prompts)
    assert [s.output for s in seqs] == [reference(path, p) for p in prompts]


def test_padding_reaching_a_state_would_change_the_tokens(models, monkeypatch):
    """Run on the whole padded width, the rows' padding enters their states and the
    tokens part from mlx-lm's: the parity above depends on running real slots only."""
    from common import kv_rows

    path = models["qwen3_next"]
    local = open_local_engine(path, num_rows=2)
    prompts = [local.tokenizer.encode(t) for t in PROMPTS]
    monkeypatch.setattr(kv_rows, "width_groups", lambda widths, t: None)
    seqs = run(local, prompts)
    assert [s.output for s in seqs] != [reference(path, p) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prefix_cache_forks_a_state_only_whole(models, family):
    """A repeated prompt is prefilled whole (its entry's state has run past the prompt);
    the next turn of a conversation (the prompt, the answer, more) forks the whole entry.
    Either way the tokens are mlx-lm's with the cache off."""
    path = models[family]
    local = engine(path, cached=True)
    prompt = local.tokenizer.encode(PROMPTS[0] + " and then some more words to cache")
    first = run(local, [prompt])[0]
    again = run(local, [prompt])[0]
    assert again.cached_tokens == 0
    assert first.output == again.output == reference(path, prompt)
    turn = prompt + first.output + local.tokenizer.encode(" and then")
    nxt = run(local, [turn])[0]
    assert nxt.cached_tokens >= len(prompt) + len(first.output) - 1
    assert nxt.output == reference(path, turn)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_layer_ranges_carry_their_kinds(models, family):
    """A stage holding layers 1-3 keeps the states of its own recurrent layers."""
    from common.layer_range import LayerRange
    from common.layer_runner import LayerRunner

    parts = load_model_parts(models[family], LayerRange(1, 3), with_ends=False)
    assert parts.caches == KINDS[family][1:]
    assert parts.recurrent  # the model's: modes are refused on every stage alike
    assert LayerRunner(parts).store.states == tuple(c.state for c in KINDS[family][1:])


@pytest.mark.parametrize("mode", ["wedlm", "speculative"])
def test_modes_that_take_rows_back_are_refused_by_name(models, mode):
    from common.errors import InvalidRequest

    local = engine(models["qwen3_next"])
    prompt = local.tokenizer.encode(PROMPTS[1])
    with pytest.raises(InvalidRequest, match=f"mode {mode} is not served for qwen3_next: it has "):
        local.engine.submit(prompt, GenerationParams(mode=mode, max_tokens=4))


def test_mode_auto_decodes_a_wedlm_record_with_ar(models, tmp_path):
    """Even a checkpoint that says it is WeDLM-trained decodes with AR under mode auto."""
    import shutil

    path = shutil.copytree(models["nemotron_h"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "wedlm": WEDLM_RECORD}))
    local = open_local_engine(path)
    assert local.engine.config.default_mode == "wedlm"
    assert local.engine.default_mode == "ar"
    prompt = local.tokenizer.encode(PROMPTS[1])
    seq = local.engine.submit(prompt, GenerationParams(max_tokens=MAX_TOKENS))
    for _ in local.engine.stream([seq]):
        pass
    assert seq.params.mode == "ar" and seq.output == reference(path, prompt)


def test_a_stage_refuses_what_would_break_a_state(models):
    """A worker keeps every state in step with its rows: a forward keeping part of a
    window, and a fork shorter than its source's state, are refused in one line."""
    import mlx.core as mx

    from common.layer_runner import LayerRunner, RowsError
    from common.rows_spec import RowsSpec

    parts = load_model_parts(models["qwen3_next"], with_ends=False)
    runner = LayerRunner(parts)
    hidden = mx.zeros((1, 4, parts.config.hidden_size))

    def spec(sid, start, keep, forks=()):
        return RowsSpec(
            [sid], np.array([start]), np.array([4]), np.ones((1, 4), bool), np.array([keep]),
            list(forks),
        )  # fmt: skip

    with pytest.raises(RowsError, match="recurrent state, which cannot take back rows"):
        runner.forward(spec(1, 0, 2), hidden)
    mx.eval(runner.forward(spec(1, 0, 4), hidden))
    with pytest.raises(RowsError, match="a recurrent state forks only at its own length"):
        runner.forward(spec(2, 2, 4, [(2, 1, 2)]), hidden)
    mx.eval(runner.forward(spec(2, 4, 4, [(2, 1, 4)]), hidden))  # the whole state forks
    assert runner.store.length(2) == 8


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_prompts_prefilled_in_chunks_carry_their_states(models, family):
    """Prompts of 12 and 4 tokens in chunks of 5 (ragged forwards: 5 and 4 rows, then 5
    and a decode row): each chunk starts from the state the previous one left."""
    path = models[family]
    local = open_local_engine(path, num_rows=2)
    local.engine.prefill_chunk = local.engine.scheduler.limits.prefill_chunk = 5
    prompts = [local.tokenizer.encode(t) for t in PROMPTS]
    assert len(prompts[0]) > 2 * 5
    seqs = run(local, prompts)
    assert [s.output for s in seqs] == [reference(path, p) for p in prompts]


def test_a_state_costs_fixed_bytes_per_sequence(models):
    """What a sequence's recurrent state costs is read from the layers (no forward run)
    and is what a stage holds for it after a prompt, long or short: Qwen3-Next's two
    linear layers each keep a conv window of 3 x 128 channels and 4 heads of 16 x 16."""
    import mlx.core as mx

    from common.layer_runner import LayerRunner
    from common.recurrent_rows import LayerState, state_bytes
    from common.rows_spec import RowsSpec

    parts = load_model_parts(models["qwen3_next"], with_ends=False)
    per_layer = (3 * 128 + 4 * 16 * 16) * 4  # float32 on the CPU
    assert state_bytes(parts.layers, parts.caches, 64, mx.float32) == 2 * per_layer
    for width in (3, 9):
        runner = LayerRunner(parts)
        spec = RowsSpec(
            [1], np.zeros(1, int), np.array([width]), np.ones((1, width), bool),
            np.array([width]),
        )  # fmt: skip
        mx.eval(runner.forward(spec, mx.zeros((1, width, 64))))
        held = [layer for b in runner.store.batches for layer in b.layers]
        states = [layer for layer in held if isinstance(layer, LayerState)]
        assert sum(s.nbytes() for s in states) == 2 * per_layer


def test_admission_counts_a_state_once_per_sequence(models):
    """The model's state (read from mlx-lm's model without weights) is what its layers
    hold; the scheduler counts it once per sequence, in KV tokens' worth, on top of the
    sequence's KV rows: a request that fits in KV alone is refused with its state."""
    import mlx.core as mx

    from common.recurrent_rows import model_state_bytes, state_bytes
    from coordinator.engine.limits import Limits
    from coordinator.engine.scheduler import QueueFull, Scheduler
    from coordinator.engine.sequence import Sequence

    parts = load_model_parts(models["qwen3_next"], with_ends=False)
    held = state_bytes(parts.layers, parts.caches, 64, mx.float32)
    assert model_state_bytes(parts.config, mx.float32) == held > 0
    params = GenerationParams(mode="ar", max_tokens=10)
    need = 5 + 10 + params.forward_rows
    Scheduler(Limits(kv_tokens=need), 1, 0, 512).add(Sequence(0, [1] * 5, params))
    with pytest.raises(QueueFull, match=f"may need {need + 40} KV rows"):
        scheduler = Scheduler(Limits(kv_tokens=need, state_tokens=40), 1, 0, 512)
        scheduler.add(Sequence(1, [1] * 5, params))


def test_kv_per_token_sits_on_a_hybrids_attention_layers(tmp_path):
    """Nemotron-H's make_cache() skips its MLP layers: with attention as layer 2 of
    M-*M, the KV per token is layer 2's (the planner splits memory by it), none elsewhere."""
    from common.layer_kv import kv_token_shapes
    from common.model_config import load_model_config

    spec = SPECS["nemotron_h"]
    path = make_mlx_checkpoint(
        tmp_path / "m", "nemotron_h", spec=spec, hybrid_override_pattern="M-*M"
    )
    shapes = kv_token_shapes(load_model_config(path))
    assert shapes == ((), (), ((2, 16), (2, 16)), ())


def test_choices_of_one_request_prefill_their_own_prompts(models):
    """n > 1: a choice cannot fork its leader's state at the prompt's last row (the state
    has run past it), so each choice prefills its prompt; both give the solo tokens."""
    path = models["qwen3_5"]
    local = open_local_engine(path, num_rows=2)
    prompt = local.tokenizer.encode(PROMPTS[0])
    leader = local.engine.submit(prompt, AR)
    other = local.engine.submit(prompt, AR, shares_with=leader)
    assert other.share_from is None
    for _ in local.engine.stream([leader, other]):
        pass
    assert leader.output == other.output == reference(path, prompt)
    assert other.shared_tokens == 0


def test_a_quantized_kv_cache_keeps_states_in_full(tmp_path):
    """--kv-bits quantizes the attention layers' KV; a state stays in the model's dtype
    (mlx-lm's layers read it as is), and the tokens stay close to mlx-lm's."""
    from common.kv_format import KVFormat
    from common.kv_rows import QuantizedLayerKV
    from common.recurrent_rows import LayerState

    path = make_mlx_checkpoint(tmp_path / "m", "qwen3_next", seed=3, spec=SPECS["qwen3_next"],
                               head_dim=32)  # fmt: skip
    local = open_local_engine(path, kv=KVFormat(bits=8, group_size=32))
    prompt = local.tokenizer.encode(PROMPTS[0])
    seq = local.engine.submit(prompt, AR)
    runner = local.engine.pipeline.runner
    kinds: set[type] = set()
    for _ in local.engine.stream([seq]):
        kinds |= {type(layer) for b in runner.store.batches for layer in b.layers}
    assert kinds == {LayerState, QuantizedLayerKV}
    want = mlx_lm_greedy(path, prompt, MAX_TOKENS, local.engine.config.eos_token_ids)
    assert seq.output[:4] == want[:4]
