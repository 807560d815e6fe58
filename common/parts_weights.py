"""Putting checkpoint weights into a module of model parts: quantizing it as the
checkpoint says (mlx-lm's load_model, module by module), then loading and materializing
the weights. A leaf: model_parts.py and diffusion/parts.py both import it, and it imports
neither."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from common.errors import CheckpointError

# quantization_config's methods that mlx-lm's load_model maps onto one MLX mode
_ONE_MODE = {
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    "mxfp8": {"group_size": 32, "bits": 8, "mode": "mxfp8"},
}
# methods whose packed weights mlx-lm rewrites before loading (not done here)
_REWRITTEN = ("awq", "gptq", "bitnet")


def checkpoint_quantization(raw: dict[str, Any], where: Path) -> dict[str, Any] | None:
    """The `quantization` mlx-lm's load_model applies to this config.json (`raw`): its own
    (defaults plus per-module entries), or the one mlx-lm derives from a Hugging Face
    `quantization_config` (openai/gpt-oss's mxfp4 experts, mxfp8, fp8 in 32x32 blocks of
    power-of-two scales, compressed-tensors, NVIDIA ModelOpt's NVFP4, in config.json or
    in hf_quant_config.json beside it). `where`: the config.json. None: not quantized."""
    if (own := raw.get("quantization")) is not None:
        if not isinstance(own, dict) or not all(
            isinstance(own.get(k), int) for k in ("group_size", "bits")
        ):
            raise CheckpointError(
                f"{where}: quantization is {own!r}; expected a dict with integer group_size "
                "and bits (and mode, per-module entries), as mlx-lm writes it"
            )
        return own
    legacy = raw.get("quantization_config") or (raw.get("text_config") or {}).get(
        "quantization_config"
    )
    modelopt = where.parent / "hf_quant_config.json"  # NVIDIA ModelOpt keeps it beside
    if not legacy and modelopt.exists():
        try:
            legacy = json.loads(modelopt.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{modelopt} is not valid JSON: {e}") from None
        if isinstance(legacy, dict):
            legacy.setdefault("quant_method", "modelopt")  # ModelOpt's own file may not say
    if not isinstance(legacy, dict) or "quant_method" not in legacy:
        return None
    method = legacy["quant_method"]
    if method in _ONE_MODE:
        return dict(_ONE_MODE[method])
    if method == "fp8":
        # power-of-two scales over 32x32 blocks are mxfp8; other fp8 checkpoints are
        # dequantized by their family's sanitize (mlx-lm's rule)
        blocks = list(legacy.get("weight_block_size", ()))
        if legacy.get("scale_fmt") == "ue8m0" and blocks == [32, 32]:
            return dict(_ONE_MODE["mxfp8"])
        return None
    if method == "compressed-tensors":
        from mlx_lm.utils import _compressed_tensors_quantization

        try:
            return _compressed_tensors_quantization(legacy)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: quantization_config: {e}") from None
    if method == "modelopt":
        settings = legacy.get("quantization", legacy)
        if settings.get("quant_algo") != "NVFP4":
            raise CheckpointError(
                f"{where}: quantization_config's quant_algo is "
                f"{settings.get('quant_algo')!r}; modelopt checkpoints load as NVFP4 only"
            )
        return {"group_size": settings.get("group_size", 16), "bits": 4, "mode": "nvfp4"}
    if method in _REWRITTEN:
        raise CheckpointError(
            f"{where}: quantization_config's quant_method {method!r} is not loaded by this "
            "engine (convert it with mlx_lm.convert first)"
        )
    return None  # as mlx-lm: a method it does not know leaves the modules as they are


def quantize_as_stored(
    parts: nn.Module,
    quant: dict[str, Any],
    weights: dict[str, mx.array],
    checkpoint_name: Callable[[str], str],
) -> None:
    """Quantize `parts` module by module as mlx-lm's load_model quantizes the whole model:
    a module the checkpoint's `quantization` names (by its path in mlx-lm's model:
    `checkpoint_name`) gets that entry (mixed bits, modes, or False), any other module
    with stored scales gets the settings its tensors' shapes and dtypes imply (mlx-lm's
    infer_quant_config), an NVFP4 switch layer with a stored global scale keeps it.
    `weights` are keyed by `parts`' own parameter names."""
    from mlx_lm.utils import _takes_global_scale, infer_quant_config

    visited: list[str] = []  # nn.quantize quantizes each module right after asking

    def predicate(path: str, module: nn.Module) -> bool | dict:
        original = checkpoint_name(path)
        visited.append(original)
        if original in quant:  # per-module override, as mlx-lm writes it
            setting = quant[original]
            if not isinstance(setting, (bool, dict)):
                raise CheckpointError(
                    f"config.json: quantization's {original!r} is {setting!r}; expected a "
                    "dict of group_size, bits and mode, or false"
                )
            return setting
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        try:
            params = infer_quant_config(path, module, weights)
        except ValueError as e:  # bits and group size no MLX mode packs
            raise CheckpointError(f"{original}: {e}") from None
        if f"{path}.global_scale" in weights and _takes_global_scale(module):
            params["global_scale"] = True
        return params

    try:
        quantize_parts(parts, quant, predicate)
    except (ValueError, TypeError) as e:  # MLX's refusal of a mode, bits or group size
        module = visited[-1] if visited else "the model"
        setting = quant.get(module, {k: quant.get(k) for k in ("group_size", "bits", "mode")})
        raise CheckpointError(f"config.json: quantization of {module} ({setting}): {e}") from None


def quantize_parts(parts: nn.Module, quant: dict[str, Any], predicate) -> None:
    """Quantize the modules `predicate` picks with a config.json's `quantization` defaults."""
    nn.quantize(
        parts,
        group_size=quant["group_size"],
        bits=quant["bits"],
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def install_weights(parts: nn.Module, weights: dict[str, mx.array], path: Path) -> None:
    """Load exactly these weights into `parts` and materialize them (float32 on a CPU)."""
    try:
        parts.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{path}: weights do not match config.json: {e}") from None
    parts.eval()
    if mx.default_device() == mx.cpu:
        # MLX's CPU backend emulates float16/bfloat16 arithmetic (tens of times slower);
        # compute in float32 there. GPUs keep the checkpoint's dtype.
        parts.set_dtype(mx.float32)
    mx.eval(parts.parameters(), _held_arrays(parts))


def _held_arrays(parts: nn.Module) -> list[mx.array]:
    """Arrays modules keep outside their parameters (a YaRN RoPE's `_freqs`, computed at
    construction). Left lazy they would belong to the stream of the thread that loaded the
    model, and the engine thread that runs the forwards could not evaluate them."""
    held = []
    for _, module in parts.named_modules():
        # an nn.Module keeps arrays as dict items ("_" names are not parameters)
        for value in [*module.values(), *vars(module).values()]:
            if isinstance(value, mx.array):
                held.append(value)
            elif isinstance(value, (list, tuple)):
                held.extend(v for v in value if isinstance(v, mx.array))
    return held
