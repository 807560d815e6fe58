"""Quantized checkpoints made the way real ones are: mlx-lm's own convert over a tiny random
checkpoint (tests/support/checkpoints.py), in bfloat16 as mlx-community publishes them, and
gpt-oss in openai's own layout (MXFP4 experts as `_blocks`/`_scales`, a Hugging Face
`quantization_config`), rebuilt from such a conversion."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

# recipe -> mlx_lm.convert's arguments
RECIPES: dict[str, dict[str, Any]] = {
    "mxfp4": {"q_mode": "mxfp4"},  # what gpt-oss's MXFP4 checkpoints ship
    "nvfp4": {"q_mode": "nvfp4"},
    "mxfp8": {"q_mode": "mxfp8"},
    "affine4": {"q_bits": 4, "q_group_size": 32},
    # per-module bits (3 and 6 by layer and role): a "mixed" mlx-community checkpoint
    "mixed_3_6": {"quant_predicate": "mixed_3_6", "q_group_size": 32},
}


def quantize_checkpoint(src: Path, out: Path, recipe: str) -> Path:
    """`src` converted by mlx_lm.convert with `recipe` (bfloat16 tensors) into `out`."""
    from mlx_lm.convert import convert

    with contextlib.redirect_stdout(io.StringIO()):  # its [INFO] lines
        convert(str(src), str(out), quantize=True, dtype="bfloat16", **RECIPES[recipe])
    return out


def _interleave(a, b, axis: int):
    """Rows of a and b alternating along `axis` (openai's fused gate_up order)."""
    import mlx.core as mx

    stacked = mx.stack([a, b], axis=axis + 1 if axis >= 0 else axis)
    shape = list(a.shape)
    shape[axis] *= 2
    return stacked.reshape(shape)


def openai_gpt_oss_layout(float_dir: Path, mxfp4_dir: Path, out: Path) -> Path:
    """gpt-oss as openai publishes it: the experts' MXFP4 tensors (from `mxfp4_dir`, an
    mxfp4 conversion of `float_dir`) as fused gate_up `_blocks`/`_scales`/`_bias` of
    uint8, everything else unquantized (from `float_dir`), config.json's
    `quantization_config` {"quant_method": "mxfp4"} and no `quantization`."""
    import mlx.core as mx

    out.mkdir(parents=True)
    plain = mx.load(str(float_dir / "model.safetensors"))
    packed = mx.load(str(mxfp4_dir / "model.safetensors"))
    weights = {k: v.astype(mx.bfloat16) for k, v in plain.items() if ".experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in packed if ".mlp.experts." in k}
    for layer in sorted(layers):
        ex = f"{layer}.mlp.experts"

        def blocks(w):  # [E, out, in/8] uint32 -> [E, out, in/32, 16] uint8
            return w.view(mx.uint8).reshape(*w.shape[:2], -1, 16)

        gate, up, down = (f"{ex}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
        gate_up = f"{ex}.gate_up_proj"
        weights[f"{gate_up}_blocks"] = blocks(
            _interleave(packed[f"{gate}.weight"], packed[f"{up}.weight"], -2)
        )
        weights[f"{gate_up}_scales"] = _interleave(
            packed[f"{gate}.scales"], packed[f"{up}.scales"], -2
        )
        weights[f"{gate_up}_bias"] = _interleave(packed[f"{gate}.bias"], packed[f"{up}.bias"], -1)
        weights[f"{ex}.down_proj_blocks"] = blocks(packed[f"{down}.weight"])
        weights[f"{ex}.down_proj_scales"] = packed[f"{down}.scales"]
        weights[f"{ex}.down_proj_bias"] = packed[f"{down}.bias"]
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in float_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    return out
