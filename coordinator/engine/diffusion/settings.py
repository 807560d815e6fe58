"""A diffusion model's decoding settings, read from its generation config as mlx-vlm's
reference sampler reads them (mlx_vlm/generate/diffusion.py), plus the turbo sampler's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.errors import CheckpointError
from common.model_config import ModelConfig

# mlx-vlm's defaults (generate/common.py, generate/diffusion.py)
DEFAULT_STEPS = 48
DEFAULT_THRESHOLD = 0.9
DEFAULT_MIN_CANVAS = 64
DEFAULT_TEMPERATURES = (0.4, 0.8)  # linear schedule t_min..t_max over the steps


@dataclass(frozen=True)
class TurboSettings:
    """The turbo sampler's techniques, each switchable (benchmarks/diffusion.py measures
    them one by one)."""

    top_k: int = 64  # exact hierarchical top-K: the sampling chain runs on K candidates
    chunk: int = 2048  # vocabulary chunk of the first (chunk-max) stage
    conditioning_k: int = 32  # self-conditioning from the top candidates' embedding rows
    thresholds: tuple[float, float] = (0.95, 0.80)  # two-stage schedule: picky, then relaxed
    relax_after: int = 8  # steps of a canvas at the picky threshold
    repair: bool = True  # one full-canvas forward once a canvas drains: its argmax commits
    eos_tail_drop: bool = True  # positions after a committed EOS stop being denoised
    repeat_guard: int = 16  # stop when a token repeats this many times in a row (0: off)
    compact: bool = True  # forward only live positions; the others keep their K/V
    # the forwarded count is rounded up to one of these shares of the canvas (duplicates
    # pad): with the whole canvas, 7 widths (16, 32, 48, 64, 96, 128, 256 of 256). Above
    # half the canvas a compacted row (scattered writes, per-slot RoPE) saved less than it
    # cost on an H100 (RESULTS.md, D5), so such a step forwards the whole canvas.
    buckets: tuple[float, ...] = (1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2)

    def bucket_sizes(self, canvas: int) -> tuple[int, ...]:
        return tuple(sorted({max(1, round(f * canvas)) for f in self.buckets}))


@dataclass(frozen=True)
class DiffusionSettings:
    canvas_length: int
    vocab_size: int
    steps: int = DEFAULT_STEPS
    threshold: float = DEFAULT_THRESHOLD
    min_canvas: int = DEFAULT_MIN_CANVAS
    temperatures: tuple[float, float] = DEFAULT_TEMPERATURES
    # stop denoising once the argmax canvas is stable for this many steps and the mean
    # entropy is below the bound (None: not configured, never)
    stability: tuple[int, float] | None = None
    turbo: TurboSettings = field(default_factory=TurboSettings)

    def temperature(self, step: int, steps: int) -> float:
        """The reference's linear schedule at `step` (counting down from `steps` to 1)."""
        t_min, t_max = self.temperatures
        return t_min + (t_max - t_min) * (step / steps)

    def canvas_for(self, remaining: int) -> int:
        """The canvas length for a request that may commit `remaining` more tokens."""
        return min(self.canvas_length, max(remaining, min(self.min_canvas, self.canvas_length)))


def _generation_config(config: ModelConfig) -> dict[str, Any]:
    gen = dict(config.raw.get("generation_config") or {})
    path = config.path / "generation_config.json"
    if path.exists():
        try:
            gen.update(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    return gen


def load_settings(config: ModelConfig) -> DiffusionSettings:
    gen = _generation_config(config)
    sampler = (gen.get("sampler_config") or {}).get("_cls_name", "EntropyBoundSamplerConfig")
    if sampler != "EntropyBoundSamplerConfig":  # the reference refuses it too
        raise CheckpointError(f"{config.path}: diffusion sampler {sampler!r} is not supported")
    temps = gen.get("linear_temperature_schedule_config") or {}
    if not temps and ("t_min" in gen or "t_max" in gen):
        temps = gen
    stop = gen.get("diffusion_stopping_config") or {
        k: gen[k] for k in ("confidence_threshold", "stability_threshold") if k in gen
    }
    steps = int(gen.get("max_denoising_steps") or DEFAULT_STEPS)
    if steps < 1:
        raise CheckpointError(f"{config.path}: max_denoising_steps must be positive")
    return DiffusionSettings(
        canvas_length=config.canvas_length,
        vocab_size=config.vocab_size,
        steps=steps,
        temperatures=(float(temps.get("t_min", 0.4)), float(temps.get("t_max", 0.8))),
        stability=(
            (
                int(stop.get("stability_threshold", 1)),
                float(stop.get("confidence_threshold", 0.005)),
            )
            if stop
            else None
        ),
    )
