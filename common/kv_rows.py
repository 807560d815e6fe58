"""A batched KV cache whose rows (sequences) each keep their own committed length.

Rows of one forward commit different amounts (WeDLM commits the leading filled run of
each window), so a uniform offset or trim is wrong. Each forward writes its T window rows
at positions length_b..length_b+T-1 of row b; `commit` then advances each row by the
number of leading rows that became permanent. Whatever lies past a row's length is stale
and is overwritten by the next forward, never read (the attention mask hides it).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.window_mask import attention_mask

GROW_STEP = 256  # capacity grows in these steps, like mlx-lm's KVCache
SPAN_STEP = 64  # attention spans are rounded up to bound the set of shapes


class LayerKV:
    """One layer's keys/values for all rows; duck-types mlx-lm's cache (offset, update)."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset: mx.array | int = 0  # RoPE start per row, set by KVRows.begin
        self._rows: KVRows | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        rows = self._rows
        assert rows is not None, "KVRows.begin() must run before a forward"
        b, _, t, _ = keys.shape
        if self.keys is None or self.keys.shape[2] < rows.capacity:
            self._grow(keys, values, rows.capacity)
        if rows.uniform_start is not None:  # one contiguous slice for all rows
            s = rows.uniform_start
            self.keys[:b, :, s : s + t, :] = keys
            self.values[:b, :, s : s + t, :] = values
        else:
            pos = mx.broadcast_to(rows.write_positions[:, None, :, None], keys.shape)
            self.keys = mx.put_along_axis(self.keys, pos, keys, axis=2)
            pos = mx.broadcast_to(rows.write_positions[:, None, :, None], values.shape)
            self.values = mx.put_along_axis(self.values, pos, values, axis=2)
        return self.keys[:b, :, : rows.span, :], self.values[:b, :, : rows.span, :]

    def _grow(self, keys: mx.array, values: mx.array, capacity: int) -> None:
        b, h, _, dk = keys.shape
        new_k = mx.zeros((b, h, capacity, dk), keys.dtype)
        new_v = mx.zeros((b, h, capacity, values.shape[3]), values.dtype)
        if self.keys is not None:
            old = self.keys.shape[2]
            new_k[:, :, :old, :] = self.keys
            new_v[:, :, :old, :] = self.values
        self.keys, self.values = new_k, new_v

    def keep_rows(self, rows: mx.array) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]


class KVRows:
    """KV for a fixed number of rows across the layers of one process."""

    def __init__(self, num_layers: int, num_rows: int, seq_ids: list[int] | None = None) -> None:
        self.layers = [LayerKV() for _ in range(num_layers)]
        self.lengths = np.zeros(num_rows, dtype=np.int64)  # host copy: no device reads
        self.seq_ids = list(seq_ids) if seq_ids is not None else list(range(num_rows))
        self.capacity = 0
        self.span = 0
        self.uniform_start: int | None = None
        self.write_positions: mx.array | None = None

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def begin(self, windows: np.ndarray) -> mx.array | str | None:
        """Prepare a forward of `windows` ([rows, T, T] visibilities) at the current lengths.

        Returns the attention mask for mlx-lm's layers (None / "causal" when the plain
        causal fast path applies, as in mlx-lm's own generation).
        """
        rows, t = windows.shape[0], windows.shape[-1]
        if rows != self.num_rows:
            raise ValueError(f"forward has {rows} rows, the cache has {self.num_rows}")
        end = int(self.lengths.max()) + t
        if end > self.capacity:
            self.capacity = -(-end // GROW_STEP) * GROW_STEP
        starts = self.lengths
        causal = np.array_equal(windows, np.broadcast_to(np.tri(t, dtype=bool), windows.shape))
        if rows == 1 or (starts == starts[0]).all():
            self.uniform_start = int(starts[0])
            self.write_positions = None
            if causal:  # identical to mlx-lm's KVCache path: exact span, no explicit mask
                self.span = end
                mask = None if t == 1 else "causal"
                self._bind(mx.array(starts[0], dtype=mx.int32))
                return mask
        else:
            self.uniform_start = None
            self.write_positions = mx.array(starts[:, None] + np.arange(t)[None, :], mx.int32)
        self.span = min(self.capacity, -(-end // SPAN_STEP) * SPAN_STEP)
        starts_mx = mx.array(starts, dtype=mx.int32)
        self._bind(starts_mx if self.uniform_start is None else mx.array(self.uniform_start))
        return attention_mask(starts_mx, mx.array(windows), self.span)

    def _bind(self, offset: mx.array) -> None:
        for layer in self.layers:
            layer.offset = offset
            layer._rows = self

    def commit(self, counts: np.ndarray | list[int]) -> None:
        """Make the first counts[b] rows of the last forward permanent for row b."""
        self.lengths = self.lengths + np.asarray(counts, dtype=np.int64)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (sequences leaving the batch)."""
        idx = mx.array(rows, dtype=mx.int32)
        for layer in self.layers:
            layer.keep_rows(idx)
        self.lengths = self.lengths[rows]
        self.seq_ids = [self.seq_ids[r] for r in rows]

    def nbytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes
            for layer in self.layers
            if layer.keys is not None
        )
