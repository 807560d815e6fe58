"""What every process needs to know about the rows of one forward, besides hidden states:
which sequence each row belongs to, where its window starts, which slots are filled, and how
many leading rows become permanent KV, and which rows start as copies of rows a process
already holds, and (diffusion models) which trailing slots are a canvas. It travels on the
wire to every worker: one byte per slot, 0 mask or padding, 1 filled, 2 canvas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.window_mask import batch_window_masks

if TYPE_CHECKING:  # the spec itself travels without MLX (tensor-free wire code)
    import mlx.core as mx


@dataclass
class RowsSpec:
    seq_ids: list[int]
    starts: np.ndarray  # [B] committed KV length of each sequence before this forward
    widths: np.ndarray  # [B] window rows of each sequence (<= width)
    filled: np.ndarray  # [B, T] False for WeDLM mask slots (and for padding)
    keeps: np.ndarray  # [B] leading rows that become permanent KV after this forward
    # (seq_id, source, length): before the forward, seq_id takes the first `length` KV rows
    # of `source`, a sequence whose rows this process keeps (a prefix-cache hit)
    forks: list[tuple[int, int, int]] = field(default_factory=list)
    # [B] trailing slots of each row's width that are a diffusion canvas: they see every
    # slot of their row (bidirectional) and the committed KV; the slots before them are
    # encoded causally. Canvas rows write no permanent KV. None: no canvas anywhere.
    canvas: np.ndarray | None = None
    # Compacted canvases (the turbo sampler's active set): [B, T] each slot's position
    # relative to its row's start (None: slot i at start + i), and [B] how many canvas
    # positions the row's canvas slots see (its whole canvas: the positions not forwarded
    # keep the K/V their last forward wrote). Only canvas-only rows are compacted.
    offsets: np.ndarray | None = None
    extent: np.ndarray | None = None
    # [B, T, T] visibilities already on the device (a look-ahead WeDLM forward, whose filled
    # slots the host does not know yet: `filled` then holds no flags). In-process only.
    visibility: mx.array | None = None

    @property
    def has_canvas(self) -> bool:
        return self.canvas is not None and bool(self.canvas.any())

    def encoded(self) -> np.ndarray:
        """[B] slots of each row before its canvas (all of its width without one)."""
        return self.widths - self.canvas if self.has_canvas else self.widths

    def slot_kinds(self) -> np.ndarray:
        """[B, T] uint8 as the wire carries them: 0 mask/padding, 1 filled, 2 canvas."""
        kinds = self.filled.astype(np.uint8)
        if self.has_canvas:
            t = np.arange(self.width)[None, :]
            enc = self.encoded()[:, None]
            kinds[(t >= enc) & (t < self.widths[:, None])] = 2
        return kinds

    @property
    def width(self) -> int:
        return int(self.filled.shape[1])

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    def windows(self) -> np.ndarray | mx.array:
        if self.visibility is not None:
            return self.visibility
        out = batch_window_masks(
            [self.filled[b, : self.widths[b]] for b in range(self.num_rows)], self.width
        )
        if self.has_canvas:
            for b, (enc, w) in enumerate(zip(self.encoded(), self.widths, strict=True)):
                out[b, enc:w, :w] = True  # a canvas slot sees its whole row
        return out

    def positions(self) -> np.ndarray:
        """[B, T] logical RoPE positions: slot i of row b sits at starts[b] + i, or at
        starts[b] + offsets[b, i] in a compacted forward."""
        if self.offsets is not None:
            return self.starts[:, None] + self.offsets
        return self.starts[:, None] + np.arange(self.width)[None, :]

    def reach(self) -> np.ndarray:
        """[B] positions past each row's start that its forward writes or reads."""
        if self.offsets is None:
            return self.widths
        return np.maximum(self.extent, self.offsets.max(axis=1) + 1)
