"""Quantized checkpoints of the new families, made the way real ones are (mlx-lm's convert:
MXFP4 as gpt-oss ships, NVFP4, MXFP8, mixed per-module bits; gpt-oss in openai's own
MXFP4 layout) load exactly as mlx-lm's `load` loads them: the same module quantized the
same way, the same logits and greedy tokens (float32 activations on both sides: like for
like); --kv-bits over them; the layer bytes the planner sees are the quantized ones; a
hub id resolves from the local Hugging Face cache offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from common.errors import CheckpointError, WedlmError
from common.generation_params import GenerationParams
from common.kv_format import KVFormat
from common.kv_rows import KVRows
from common.layer_range import LayerRange
from common.layer_runner import LayerRunner
from common.layer_sizes import (
    compute_dtype,
    estimated_layer_bytes,
    layer_weight_bytes,
    loaded_layer_bytes,
)
from common.model_config import load_model_config
from common.model_parts import load_model_parts, run_layers
from common.parts_weights import checkpoint_quantization
from coordinator.engine.local_engine import open_local_engine
from tests.support.checkpoints import make_checkpoint, make_mlx_checkpoint, mlx_lm_greedy
from tests.support.hub_cache import add_to_hub_cache
from tests.support.quantized_checkpoints import openai_gpt_oss_layout, quantize_checkpoint

PROMPT = "once upon a time there was a little robot who liked to count"
MAX_TOKENS = 16
# (family, recipe): the checkpoints greedy decoding is compared on
GREEDY = [
    ("gpt_oss", "mxfp4"),  # MXFP4 experts and attention, 8-bit affine routers (mlx-lm's)
    ("gpt_oss", "openai"),  # openai's layout: quantization_config, `_blocks`
    ("gpt_oss", "mixed_3_6"),
    ("deepseek_v3", "mxfp4"),
    ("deepseek_v3", "mixed_3_6"),
    ("qwen3", "mixed_3_6"),
]
LOGITS = [(f, r) for f in ("qwen3", "gpt_oss", "deepseek_v3") for r in ("nvfp4", "mxfp8")]
# the other families served (tests/support/checkpoints.py), MXFP4 and mixed: modules and logits
OTHERS = (
    "gemma3_text", "gemma3", "gemma2", "glm4", "olmo2", "granite", "cohere2", "kimi_k2",
    "glm4_moe", "minimax", "mistral3", "llama4_text", "qwen3_moe", "llama",
)  # fmt: skip
LOGITS += [(f, r) for f in OTHERS for r in ("mxfp4", "mixed_3_6")]
TRANSFORMERS_MADE = ("qwen3", "qwen3_moe", "llama")  # make_checkpoint's (hub names)


class Checkpoints:
    """Float checkpoints per family and their conversions, made once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple[str, str], Path] = {}

    def __call__(self, family: str, recipe: str) -> Path:
        key = (family, recipe)
        if key in self.made:
            return self.made[key]
        if recipe == "float":
            out = self.root / family
            if family in TRANSFORMERS_MADE:  # head dim 32: a KV group size divides it
                path = make_checkpoint(out, family, seed=3, head_dim=32)
            else:
                path = make_mlx_checkpoint(out, family, seed=3)
        elif recipe == "openai":
            float_dir, packed = self(family, "float"), self(family, "mxfp4")
            path = openai_gpt_oss_layout(float_dir, packed, self.root / f"{family}-openai")
        else:
            path = quantize_checkpoint(
                self(family, "float"), self.root / f"{family}-{recipe}", recipe
            )
        self.made[key] = path
        return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("quantized"))


def quantization_of(model: nn.Module, rename=lambda p: p) -> dict[str, tuple]:
    """Every quantized module: its class, bits, group size and mode."""
    out = {}
    for path, m in model.named_modules():
        if hasattr(m, "bits") and hasattr(m, "group_size"):
            out[rename(path)] = (type(m).__name__, m.bits, m.group_size, getattr(m, "mode", None))
    return out


def mlx_lm_model(path: Path) -> nn.Module:
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    model.set_dtype(mx.float32)  # as load_model_parts on a CPU
    return model


def logits(parts, tokens: mx.array) -> np.ndarray:
    kv = KVRows(len(parts.layers), 1)
    t = tokens.shape[1]
    return np.array(
        parts.head(run_layers(parts, parts.embed(tokens), kv, np.tri(t, dtype=bool)[None]))
    )


TOKENS = mx.array([[5, 17, 99, 3, 250, 7, 42, 8, 301, 11, 64, 2]])


@pytest.mark.parametrize(("family", "recipe"), GREEDY + LOGITS)
def test_modules_and_logits_are_mlx_lms(checkpoints, family, recipe):
    """Module by module the quantization mlx-lm's load applies (mixed bits and modes in one
    model included); the logits equal mlx-lm's, fused projections or not."""
    path = checkpoints(family, recipe)
    ref = mlx_lm_model(path)
    own = load_model_parts(path, fuse=False)
    theirs = quantization_of(ref)
    assert quantization_of(own, own.checkpoint_name) == theirs
    assert {mode for _, _, _, mode in theirs.values()} >= {
        "openai": {"mxfp4"}, "mixed_3_6": {"affine"}
    }.get(recipe, {recipe})  # fmt: skip
    if recipe == "mixed_3_6":
        assert {bits for _, bits, _, _ in theirs.values()} == {3, 6}
    want = np.array(ref(TOKENS))
    np.testing.assert_allclose(logits(own, TOKENS), want, rtol=1e-5, atol=1e-5)
    fused = load_model_parts(path)
    np.testing.assert_allclose(logits(fused, TOKENS), want, rtol=1e-5, atol=1e-5)


def fused_groups(parts) -> list[str]:
    return [p for p, _ in parts.named_modules() if p.endswith(("qkv_proj", "gate_up_proj"))]


def test_projections_fuse_in_every_mode_and_only_alike(checkpoints):
    """q/k/v fuse into one MXFP4 (or NVFP4) matmul, exactly; in a mixed checkpoint a v_proj
    of 6 bits beside 3-bit q/k keeps the layer's own projections."""
    for recipe in ("mxfp4", "nvfp4"):
        parts = load_model_parts(checkpoints("qwen3", recipe))
        qkv = parts.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, nn.QuantizedLinear) and qkv.mode == recipe
        assert len(fused_groups(parts)) == 2 * len(parts.layers)  # qkv and gate_up
    mixed = load_model_parts(checkpoints("qwen3", "mixed_3_6"))
    bits = {p: m.bits for p, m in mixed.named_modules() if isinstance(m, nn.QuantizedLinear)}
    for i in range(len(mixed.layers)):
        attn = f"layers.{i}.self_attn"
        if f"{attn}.v_proj" in bits:  # q/k/v differ here: not fused
            assert bits[f"{attn}.v_proj"] != bits[f"{attn}.q_proj"]
        else:
            assert f"{attn}.qkv_proj" in bits


@pytest.mark.parametrize(("family", "recipe"), GREEDY)
def test_greedy_tokens_equal_mlx_lms(checkpoints, family, recipe):
    path = checkpoints(family, recipe)
    local = open_local_engine(path)
    prompt = local.tokenizer.encode(PROMPT)
    want = mlx_lm_greedy(path, prompt, MAX_TOKENS, local.engine.config.eos_token_ids)
    assert len(set(want)) > 2, "degenerate random model: the test would prove little"
    seq = local.engine.submit(prompt, GenerationParams(mode="ar", max_tokens=MAX_TOKENS))
    for _ in local.engine.stream([seq]):
        pass
    assert seq.output == want


def test_layer_bytes_the_planner_sees_are_the_quantized_ones(checkpoints):
    """Each layer's bytes from the safetensors headers (what the planner splits by, before
    anything loads) equal what that layer holds once loaded, layers of more bits in a mixed
    checkpoint included, and are the quantized sizes, not the float ones."""
    cases = [("gpt_oss", "mxfp4"), ("gpt_oss", "openai"), ("qwen3", "mixed_3_6"),
             ("deepseek_v3", "mixed_3_6")]  # fmt: skip
    for family, recipe in cases:
        path = checkpoints(family, recipe)
        config = load_model_config(path)
        dtype = compute_dtype(config)
        sizes = layer_weight_bytes(config, dtype)
        loaded = [
            loaded_layer_bytes(load_model_parts(path, LayerRange(i, i), with_ends=False))
            for i in range(config.num_layers)
        ]
        assert list(sizes) == loaded, (family, recipe)
        assert estimated_layer_bytes(config, dtype) == sum(loaded) // config.num_layers
        plain = load_model_config(checkpoints(family, "float"))
        float_sizes = layer_weight_bytes(plain, compute_dtype(plain))
        assert all(q < 0.6 * f for q, f in zip(sizes, float_sizes, strict=True))
        if recipe == "mixed_3_6" and family == "qwen3":
            assert len(set(sizes)) > 1  # 6-bit v_proj/down_proj in some layers only


def test_kv_bits_over_quantized_weights(checkpoints, tmp_path):
    """--kv-bits 8 over MXFP4 weights: mlx-lm's tokens with its quantized KV cache; gpt-oss
    (attention sinks, which mlx-lm's quantized attention lacks) is refused in one line."""
    path = checkpoints("qwen3", "mxfp4")
    kv = KVFormat(bits=8, group_size=32)
    local = open_local_engine(path, kv=kv)
    prompt = local.tokenizer.encode(PROMPT)
    from mlx_lm.generate import generate_step

    model = mlx_lm_model(path)
    steps = generate_step(
        mx.array(prompt), model, max_tokens=MAX_TOKENS, kv_bits=8, kv_group_size=32,
        quantized_kv_start=0,
    )  # fmt: skip
    want = [int(t) for t, _ in steps]
    seq = local.engine.submit(prompt, GenerationParams(mode="ar", max_tokens=MAX_TOKENS))
    for _ in local.engine.stream([seq]):
        pass
    assert seq.output == want
    # head dim 32, so that the KV group size divides it and the sinks are what stops it
    float_dir = make_mlx_checkpoint(tmp_path / "g", "gpt_oss", seed=3, head_dim=32)
    gpt_oss = load_model_parts(quantize_checkpoint(float_dir, tmp_path / "g4", "mxfp4"))
    with pytest.raises(WedlmError, match=r"gpt_oss cannot keep its KV quantized.*sinks"):
        LayerRunner(gpt_oss, kv)


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_quantization_that_disagrees_with_the_weights_is_refused_in_one_line(checkpoints, tmp_path):
    path = checkpoints("gpt_oss", "mxfp4")
    router = "model.layers.0.mlp.router"

    def four_bit_router(config):
        config["quantization"][router] = {"group_size": 32, "bits": 4}

    bad = _edited(path, tmp_path / "router", four_bit_router)
    with pytest.raises(
        CheckpointError, match=rf"tensor {router}\.\w+ has shape .*config\.json expects"
    ):
        load_model_parts(bad)

    for setting, said in (
        ({"group_size": 64, "bits": 8, "mode": "fp3"}, r"Invalid quantization mode 'fp3'"),
        ({"group_size": 64, "bits": 9}, r"bits 9 is not supported"),
        ("eight", r"is 'eight'; expected a dict of group_size, bits and mode, or false"),
    ):

        def set_router(config, setting=setting):
            config["quantization"][router] = setting

        bad = _edited(path, tmp_path / f"router-{len(str(setting))}", set_router)
        with pytest.raises(CheckpointError, match=rf"config\.json: quantization.*{said}"):
            load_model_parts(bad)

    def no_bits(config):
        config["quantization"] = {"mode": "mxfp4"}

    bad = _edited(path, tmp_path / "no-bits", no_bits)
    with pytest.raises(CheckpointError, match=r"config\.json: quantization is .*expected a dict"):
        load_model_parts(bad)

    def awq(config):
        del config["quantization"]
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}

    bad = _edited(path, tmp_path / "awq", awq)
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config's "
                       r"quant_method 'awq' is not loaded by this engine"):  # fmt: skip
        load_model_parts(bad)

    def fp8_tensors(config):
        del config["quantization"]
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized"
        }  # fmt: skip

    bad = _edited(path, tmp_path / "fp8", fp8_tensors)
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config: "
                       r"unsupported compressed-tensors format 'float-quantized'"):  # fmt: skip
        load_model_parts(bad)


def wedlm_generate(model: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wedlm_client.cli", "generate", "--model", model,
         "--prompt", PROMPT, "--mode", "ar", "--max-tokens", str(MAX_TOKENS), "--json",
         *extra],
        capture_output=True, text=True, timeout=180, env={**os.environ, **env},
    )  # fmt: skip


def test_a_hub_id_resolves_from_the_local_cache_offline(checkpoints, tmp_path):
    """`wedlm generate --model org/name` (and `--draft-model org/name`) with no network:
    the cached snapshot, mlx-lm's tokens; an id that is not cached is one line, no
    traceback."""
    path = checkpoints("gpt_oss", "mxfp4")
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(add_to_hub_cache(tmp_path / "hub", "wedlm-tests/gpt-oss-mxfp4", path)),
    }
    # the draft model named by its hub id too (verified drafts: still mlx-lm's tokens)
    out = wedlm_generate(
        "wedlm-tests/gpt-oss-mxfp4", env, "--mode", "speculative", "--draft", "model",
        "--draft-model", "wedlm-tests/gpt-oss-mxfp4",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    local = open_local_engine(path)
    prompt = local.tokenizer.encode(PROMPT)
    want = mlx_lm_greedy(path, prompt, MAX_TOKENS, local.engine.config.eos_token_ids)
    result = json.loads(out.stdout)
    assert result["tokens"] == want and result["drafted_tokens"] > 0
    out = wedlm_generate("wedlm-tests/not-cached", env)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    (line,) = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert "wedlm-tests/not-cached is not a folder here and not in the Hugging Face cache" in line


# a conversion's config.json rewritten in a Hugging Face form: (recipe, the form, the
# file it goes in); mlx-lm's load_model derives the quantization from each
HF_FORMS = {
    "mxfp8": ("mxfp8", {"quant_method": "mxfp8"}, "config.json"),
    "fp8-ue8m0": (
        "mxfp8",
        {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
        "config.json",
    ),
    "compressed-tensors": (
        "mxfp4",
        {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
        "config.json",
    ),
    "modelopt": (
        "nvfp4",
        {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}},
        "hf_quant_config.json",
    ),
}


@pytest.mark.parametrize("form", list(HF_FORMS))
def test_hugging_face_quantization_configs_load_as_mlx_lm_derives_them(checkpoints, tmp_path, form):
    from mlx_lm.utils import load_model

    recipe, settings, where = HF_FORMS[form]

    def rewrite(config):
        del config["quantization"], config["quantization_config"]
        if where == "config.json":
            config["quantization_config"] = settings

    path = _edited(checkpoints("qwen3", recipe), tmp_path / form, rewrite)
    if where != "config.json":
        (path / where).write_text(json.dumps(settings))
    ref, ref_config = load_model(path)
    ref.set_dtype(mx.float32)
    config = load_model_config(path)
    assert checkpoint_quantization(config.raw, path / "config.json") == ref_config["quantization"]
    own = load_model_parts(path)
    unfused = load_model_parts(path, fuse=False)
    assert quantization_of(unfused, unfused.checkpoint_name) == quantization_of(ref)
    np.testing.assert_allclose(logits(own, TOKENS), np.array(ref(TOKENS)), rtol=1e-5, atol=1e-5)


def test_nvfp4_experts_keep_their_global_scales(checkpoints, tmp_path):
    """NVFP4 switch layers with a per-expert tensor scale (mlx-lm's quantize_model with
    global_scale): loaded as mlx-lm loads them, named in config.json or only found in the
    weights (as a ModelOpt export leaves them). MLX runs global scales on GPUs only, so
    here the modules and the scales are compared, not the forward."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, load_model, quantize_model, save

    src = checkpoints("gpt_oss", "float")
    model, tokenizer, config = load(str(src), return_config=True, lazy=True)
    model, config = quantize_model(model, config, None, None, mode="nvfp4", global_scale=True)
    path = tmp_path / "nvfp4"
    save(path, src, model, tokenizer, config)
    experts = [k for k in config["quantization"] if ".experts." in k]
    assert experts and all(config["quantization"][k]["global_scale"] for k in experts)
    for named in (True, False):
        if not named:  # only the weights say which layers hold a global scale
            for k in experts:
                del config["quantization"][k]
            (path / "config.json").write_text(json.dumps(config))
        ref, _ = load_model(path)
        own = load_model_parts(path, fuse=False)
        assert quantization_of(own, own.checkpoint_name) == quantization_of(ref)
        ours = {
            own.checkpoint_name(k): v
            for k, v in tree_flatten(own.parameters())
            if k.endswith("global_scale")
        }
        theirs = {k: v for k, v in tree_flatten(ref.parameters()) if k.endswith("global_scale")}
        assert len(ours) == 3 * 4 and sorted(ours) == sorted(theirs)  # 3 per layer
        assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
