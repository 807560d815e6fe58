"""One matmul for the projections that read the same input (issue 35): attention's q, k and
v, and the MLP's gate and up, as vLLM's QKV and merged gate-up layers do.

A decode forward on MLX is bound by what each kernel costs the host, not by reading the
weights (RESULTS SC3, SC13): a layer's 7 quantized matmuls are 211 of a 135M model's ~830
ops per forward. Fusing q/k/v and gate/up makes them 4 per layer, for AR and for wide
forwards alike: on an H200 a forward of r2 costs 0.92-1.01x the unfused one, one row and
16 rows alike (RESULTS SC14).

The fusion is exact: every output row of a linear layer (and, quantized, its scales and
biases: groups run along the input, in every MLX mode: affine, mxfp4, nvfp4, mxfp8) is its
own, so stacking the layers' rows and slicing the product gives each layer's output.
Projections quantized unalike (a mixed checkpoint's 6-bit v_proj beside 3-bit q/k, another
mode, group size or dtype) keep their own calls. mlx-lm's model code is kept as it is: the old names
(`q_proj`, ...) become slices of one shared product, computed once per input, and the fused
weights live once under `qkv_proj` / `gate_up_proj` (mlx-lm's Phi-3 names). A llama or
qwen2 attention whose q/k/v were fused also ropes q and k in one call
(common/fused_attention.py)."""

from __future__ import annotations

import copy
import itertools

import mlx.core as mx
import mlx.nn as nn

from common import fused_attention
from common.env_switches import FUSED_PROJECTIONS

GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear)


def enabled() -> bool:
    """`WEDLM_FUSED_PROJECTIONS=0` keeps the layers' own projections (A/B runs)."""
    return FUSED_PROJECTIONS.read() != "0"


class SharedProduct:
    """The fused product of the latest input, handed out in slices. A plain object, not an
    nn.Module, so that the fused weights appear once in the parameter tree."""

    def __init__(self, linear: nn.Module, widths: list[int]) -> None:
        self.linear = linear
        self.bounds = list(itertools.accumulate(widths))[:-1]
        self.count = len(widths)
        self.input: mx.array | None = None
        self.parts: list[mx.array] = []
        self.taken: set[int] = set()

    def part(self, index: int, x: mx.array) -> mx.array:
        if x is not self.input:  # a new input (mlx-lm passes the same array to each)
            self.parts = mx.split(self.linear(x), self.bounds, axis=-1)
            self.input, self.taken = x, set()
        out = self.parts[index]
        self.taken.add(index)
        if len(self.taken) == self.count:  # every slice served: hold no graph past the layer
            self.input, self.parts = None, []
        return out


class ProjectionSlice(nn.Module):
    """A projection's output as a slice of its group's fused product, under its old name."""

    def __init__(self, shared: SharedProduct, index: int) -> None:
        super().__init__()
        self._shared = shared
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._shared.part(self._index, x)


def _fusable(linears: list[nn.Module]) -> bool:
    first = linears[0]
    if type(first) not in LINEAR_TYPES or any(type(m) is not type(first) for m in linears):
        return False  # sharded, LoRA or already fused layers keep their own calls
    keys = sorted(k for k, v in first.items() if isinstance(v, mx.array))
    for m in linears:
        arrays = sorted(k for k, v in m.items() if isinstance(v, mx.array))
        if arrays != keys or m["weight"].shape[1:] != first["weight"].shape[1:]:
            return False
        if any(m[k].dtype != first[k].dtype for k in keys):
            return False
        settings = ("group_size", "bits", "mode")
        if any(getattr(m, s, None) != getattr(first, s, None) for s in settings):
            return False
    return True


def _fuse(linears: list[nn.Module]) -> nn.Module:
    fused = copy.copy(linears[0])  # the same class and settings (bits, group size, mode)
    for key, value in linears[0].items():
        if isinstance(value, mx.array):  # weight, scales, biases, bias: rows are outputs
            fused[key] = mx.concatenate([m[key] for m in linears], axis=0)
    return fused


def _fuse_layer(layer: nn.Module) -> int:
    fused_groups = 0
    for _, module in layer.named_modules():
        for fused_name, names in GROUPS.items():
            linears = [module.get(n) for n in names]
            if fused_name in module or any(m is None for m in linears):
                continue
            if not _fusable(linears):
                continue
            fused = _fuse(linears)
            mx.eval(fused.parameters())
            widths = [m["weight"].shape[0] for m in linears]
            shared = SharedProduct(fused, widths)
            module[fused_name] = fused
            for i, name in enumerate(names):
                setattr(module, name, ProjectionSlice(shared, i))
            if fused_name == "qkv_proj":
                fused_attention.adopt(module)  # q and k through one rope call
            fused_groups += 1
    return fused_groups


def fuse_projections(layers: list[nn.Module]) -> int:
    """Fuse every group of GROUPS found in `layers`' modules, in place, layer by layer.
    Returns how many groups were fused."""
    fused_groups = 0
    for layer in layers:
        fused_groups += _fuse_layer(layer)
        # that layer's unfused weights went to MLX's buffer cache: give them back now, so
        # that a model which fills the machine's memory loads within about its own size
        mx.clear_cache()
    return fused_groups
