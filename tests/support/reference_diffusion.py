"""mlx-vlm's own DiffusionGemma sampler, run as its users run it: the model loaded by
mlx-vlm, the prompt prefilled into its caches, canvases denoised one request at a time
(`stream_diffusion_generate`). The parity tests compare the cluster's faithful mode with
its tokens."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx


@lru_cache(maxsize=4)
def _load(path: str):
    from mlx_vlm.utils import load_model, load_processor

    model = load_model(Path(path))
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)  # as the cluster computes on a CPU
    eos = model.config.eos_token_id
    processor = load_processor(Path(path), eos_token_ids=eos if isinstance(eos, list) else [eos])
    return model, processor


def reference_tokens(
    path: Path,
    prompt: list[int],
    max_tokens: int,
    seed: int = 0,
    steps: int | None = None,
    temperature: float = 0.0,
) -> list[int]:
    """The tokens mlx-vlm generates after `mx.random.seed(seed)`."""
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    model, processor = _load(str(path))
    mx.random.seed(seed)
    tokens = []
    results = stream_diffusion_generate(
        model,
        processor,
        getattr(processor, "tokenizer", processor),
        mx.array([prompt]),
        None,
        None,
        max_tokens=max_tokens,
        skip_special_token_ids=[],
        temperature=temperature,
        max_denoising_steps=steps,
    )
    for r in results:
        if r.token is not None and not r.diffusion_block_complete and r.finish_reason is None:
            tokens.append(int(r.token))
        last = r
    if last.finish_reason == "stop" and (not tokens or tokens[-1] != last.token):
        tokens.append(int(last.token))  # the stop token ends the output, as generate() does
    return tokens
