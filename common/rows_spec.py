"""What every process needs to know about the rows of one forward, besides hidden states:
which sequence each row belongs to, where its window starts, which slots are filled, and how
many leading rows become permanent KV, and which rows start as copies of rows a process
already holds. It travels on the wire to every worker."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.window_mask import batch_window_masks


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

    @property
    def width(self) -> int:
        return int(self.filled.shape[1])

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    def windows(self) -> np.ndarray:
        return batch_window_masks(
            [self.filled[b, : self.widths[b]] for b in range(self.num_rows)], self.width
        )

    def positions(self) -> np.ndarray:
        """[B, T] logical RoPE positions: slot i of row b sits at starts[b] + i."""
        return self.starts[:, None] + np.arange(self.width)[None, :]
