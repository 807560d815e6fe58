"""Diffusion decoding (DiffusionGemma): canvases denoised over several forwards, batched
across requests, beside WeDLM and autoregressive decoding in the same engine."""
