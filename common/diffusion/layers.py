"""One process's DiffusionGemma layers over a batch of rows. A row may hold encoder slots
(prompt chunks, a committed canvas: causal, their KV kept) followed by a canvas (denoised
bidirectionally, reading the committed KV, kept nowhere), so a request's commit and its
next canvas's first denoising step share one forward. Each row keeps its own committed
length in the KV (common/kv_rows.py), so canvases of many requests batch together.

Attention is the model's own (mlx-vlm's layers) over our batched KV, with explicit masks:
full-attention layers see what the window visibility allows; sliding layers additionally
see only the last `sliding_window` positions, as the model's encoder (a query sees the
window ending at itself) and decoder (a canvas sees the last `sliding_window - 1`
committed positions) do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.diffusion.parts import DiffusionParts
from common.kv_rows import GROW_STEP, SPAN_STEP, KVRows
from common.rows_spec import RowsSpec
from common.window_mask import attention_mask

LAUNCH_EVERY = 6  # as common/model_parts.py: start the device on the layers built so far


def sliding_lower_bounds(spec: RowsSpec, window: int) -> np.ndarray:
    """[B, T] the first cache position slot i of row b may see in a sliding layer."""
    slot = np.arange(spec.width)[None, :]
    enc = spec.encoded()[:, None]
    # an encoder slot sees the `window` positions ending at itself; a canvas slot the last
    # `window - 1` positions before the canvas (the committed ones, its row's encoder slots
    # included)
    return spec.starts[:, None] + np.minimum(slot, enc) - (window - 1)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def begin_scattered(kv: KVRows, spec: RowsSpec) -> None:
    """KVRows.begin for a compacted forward: each slot writes its K/V at its own position
    and is rotated by it (per-slot RoPE offsets); the KV covers every row's canvas."""
    positions = spec.positions()
    end = int((spec.starts + spec.reach()).max())
    if end > kv.capacity:
        kv.capacity = _round_up(end, GROW_STEP)
    kv.span = min(kv.capacity, _round_up(end, SPAN_STEP))
    kv.uniform_start = None
    kv.write_positions = mx.array(positions, dtype=mx.int32)
    kv._bind(kv.write_positions)


def diffusion_masks(
    parts: DiffusionParts, kv: KVRows, spec: RowsSpec, windows: np.ndarray
) -> tuple[mx.array, mx.array]:
    """(full-attention mask, sliding mask), both [B, 1, T, span] bool."""
    # KVRows.begin sizes the KV and binds each row's RoPE offset; its causal fast path
    # (no mask) does not apply: the sliding layers need one
    full = kv.begin(windows) if spec.offsets is None else begin_scattered(kv, spec)
    starts = mx.array(spec.starts, dtype=mx.int32)
    if not isinstance(full, mx.array):
        full = attention_mask(starts, mx.array(windows), kv.span)
    if spec.offsets is not None:
        # a canvas-only row sees the committed KV and its whole canvas, wherever its
        # forwarded slots sit in it
        canvas_only = mx.array(spec.encoded() == 0)[:, None, None, None]
        rel = mx.arange(kv.span)[None, :] - starts[:, None]
        seen = (rel < mx.array(spec.extent, dtype=mx.int32)[:, None])[:, None, None, :]
        full = mx.where(canvas_only, seen, full)
    lower = mx.array(sliding_lower_bounds(spec, parts.sliding_window), dtype=mx.int32)
    in_window = mx.arange(kv.span)[None, None, :] >= lower[:, :, None]
    return full, full & in_window[:, None, :, :]


def canvas_slots(spec: RowsSpec) -> mx.array | bool:
    """[B, T, 1] which slots are canvas slots; False: none, True: all of them."""
    if not spec.has_canvas:
        return False
    is_canvas = np.arange(spec.width)[None, :] >= spec.encoded()[:, None]
    return True if is_canvas.all() else mx.array(is_canvas)[:, :, None]


def slot_scalars(parts: DiffusionParts, layer: int, canvas: mx.array | bool) -> mx.array | None:
    """The layer's output scalar per slot: the encoder's for encoder slots, the decoder's
    (the layer's own) for canvas slots. None: every slot is a canvas slot."""
    enc = parts.encoder_scalars[layer].layer_scalar
    if canvas is False:
        return enc
    if canvas is True:
        return None
    return mx.where(canvas, parts.layers[layer].layer_scalar, enc)


def run_diffusion_layers(
    parts: DiffusionParts, hidden: mx.array, kv: KVRows, spec: RowsSpec
) -> mx.array:
    full, sliding = diffusion_masks(parts, kv, spec, spec.windows())
    canvas = canvas_slots(spec)  # once per forward, not per layer
    if spec.has_canvas:  # later compacted forwards read these canvases' K/V
        kv.reserve(np.where(spec.canvas > 0, spec.starts + spec.reach(), 0))
    for i, (layer, cache) in enumerate(zip(parts.layers, kv.layers, strict=True), 1):
        hidden = layer(
            hidden,
            sliding if parts.sliding[i - 1] else full,
            cache,
            offset=cache.offset,  # the rows' starts: never read back from the device
            layer_scalar=slot_scalars(parts, i - 1, canvas),
        )
        if LAUNCH_EVERY and i % LAUNCH_EVERY == 0 and i < len(parts.layers):
            mx.async_eval(hidden)
    return hidden
