"""Block-diffusion models (DiffusionGemma): their layers, run from mlx-vlm's own modules."""
