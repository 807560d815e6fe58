"""mlx-vlm, the optional dependency that carries DiffusionGemma's model modules and its
reference sampler (`pip install "wedlm-cluster[diffusion]"`)."""

from __future__ import annotations

from types import ModuleType

from common.errors import CheckpointError

INSTALL_HINT = 'pip install "wedlm-cluster[diffusion]"'


def diffusion_gemma() -> ModuleType:
    """mlx_vlm.models.diffusion_gemma, or a clear error naming the extra to install."""
    try:
        from mlx_vlm.models import diffusion_gemma as module
    except ImportError as e:
        raise CheckpointError(
            f"DiffusionGemma checkpoints run on mlx-vlm's model modules, which are not "
            f"installed ({e}): {INSTALL_HINT}"
        ) from None
    return module
