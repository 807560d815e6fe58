"""What one denoising step decides for a group of canvases, on the device until the
micro-batch's one host sync; then split per request."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from coordinator.engine.diffusion.canvas import Canvas


@dataclass
class StepResult:
    rows: list[int]  # the batch rows these canvases occupy
    tokens: mx.array  # [n, K] the next forward's canvas input
    draft: mx.array  # [n, K] revealed tokens
    revealed: mx.array  # [n, K] bool (padding slots: True)
    argmax: mx.array  # [n, K] this forward's argmax (the reference commits it)
    conditioning: mx.array | None  # [n, K, H] soft embeddings for the next forward
    entropy: mx.array | None = None  # [n] mean token entropy (stability stop)

    def arrays(self) -> list[mx.array]:
        out = [self.tokens, self.draft, self.revealed, self.argmax]
        return out + [a for a in (self.entropy,) if a is not None]

    def host(self) -> dict[str, np.ndarray]:
        """After the sync: the small arrays on the host (conditioning stays on device)."""
        out = {
            "tokens": np.array(self.tokens),
            "draft": np.array(self.draft),
            "revealed": np.array(self.revealed),
            "argmax": np.array(self.argmax),
        }
        if self.entropy is not None:
            out["entropy"] = np.array(self.entropy)
        return out


def pad_rows(rows: list[np.ndarray], width: int, fill, dtype) -> np.ndarray:
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : r.size] = r
    return out


def padded_device(rows: list[mx.array], width: int) -> mx.array:
    """[n, width] from per-row [L_i] device arrays, zero padded."""
    return mx.stack([mx.pad(r, (0, width - r.shape[0])) if r.shape[0] < width else r for r in rows])


def canvas_arrays(canvases: list[Canvas], width: int) -> tuple[mx.array, mx.array]:
    """(revealed [n, K], draft [n, K]) with padding slots revealed (never chosen)."""
    revealed = pad_rows([c.revealed for c in canvases], width, True, bool)
    draft = pad_rows([c.draft for c in canvases], width, 0, np.int32)
    return mx.array(revealed), mx.array(draft)
