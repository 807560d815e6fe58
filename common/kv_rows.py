"""A batched KV cache whose rows (sequences) each keep their own committed length.

Rows of one forward commit different amounts (WeDLM commits the leading filled run of
each window), so a uniform offset or trim is wrong. Each forward writes its T window rows
at positions length_b..length_b+T-1 of row b; `commit` then advances each row by the
number of leading rows that became permanent. Whatever lies past a row's length is stale
and is overwritten by the next forward, never read (the attention mask hides it).

With `kv_bits` set, keys and values are stored quantized (mlx's affine quantization along
the head dimension: packed words, scales, biases) and attention runs through mlx-lm's
quantized path, which it takes for any cache with `bits` and `group_size`.

A hybrid family's recurrent layers (linear attention, Mamba) hold a LayerState instead
(common/recurrent_rows.py): fixed-size state per row, gathered and kept with the rows,
never quantized, and never rolled back (`state_at` says how far each row's state ran).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from common.kv_format import FULL, KVFormat
from common.recurrent_rows import Groups, LayerState, width_groups
from common.window_mask import attention_mask, compiled_attention_mask

Stored = mx.array | tuple[mx.array, ...]  # one tensor, or the parts of a quantized one


def parts_of(stored: Stored) -> tuple[mx.array, ...]:
    return stored if isinstance(stored, tuple) else (stored,)


def like(stored: Stored, parts) -> Stored:
    """`parts` in the form of `stored` (a tuple, or the one array)."""
    parts = tuple(parts)
    return parts if isinstance(stored, tuple) else parts[0]


GROW_STEP = 256  # capacity grows in these steps, like mlx-lm's KVCache
SPAN_STEP = 64  # attention spans are rounded up to bound the set of shapes


class LayerKV:
    """One layer's keys/values for all rows; duck-types mlx-lm's cache (offset, update)."""

    def __init__(self) -> None:
        self.keys: Stored | None = None
        self.values: Stored | None = None
        self.offset: mx.array | int = 0  # RoPE start per row, set by KVRows.begin
        # The KVRows this layer belongs to, weakly: a strong reference would make a cycle,
        # and a dropped batch's buffers would then wait for Python's cycle collector (which
        # runs on object counts, not bytes) while the device runs out of memory.
        self._rows: weakref.ref[KVRows] | None = None

    def encode(self, x: mx.array) -> Stored:
        """What is stored for new keys or values [rows, heads, T, dim]."""
        return x

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Stored, Stored]:
        rows = self._rows() if self._rows is not None else None
        assert rows is not None, "KVRows.begin() must run before a forward"
        b, _, t, _ = keys.shape
        keys, values = self.encode(keys), self.encode(values)
        if self.keys is None or parts_of(self.keys)[0].shape[2] < rows.capacity:
            self._grow(keys, values, rows.capacity)
        span = rows.span
        if isinstance(keys, mx.array):  # a float cache: one array each, no parts to map
            self.keys = _write_part(self.keys, keys, rows, t)
            self.values = _write_part(self.values, values, rows, t)
            return self.keys[:b, :, :span, :], self.values[:b, :, :span, :]
        self.keys = _write(self.keys, keys, rows, t)
        self.values = _write(self.values, values, rows, t)
        return (
            like(self.keys, (a[:b, :, :span, :] for a in parts_of(self.keys))),
            like(self.values, (a[:b, :, :span, :] for a in parts_of(self.values))),
        )

    def _grow(self, keys: Stored, values: Stored, capacity: int) -> None:
        self.keys = _grown(self.keys, keys, capacity)
        self.values = _grown(self.values, values, capacity)

    def keep_rows(self, rows: mx.array, capacity: int) -> None:
        """Keep these rows and the first `capacity` positions (one gather)."""
        if self.keys is not None:
            self.keys = like(self.keys, (a[rows, :, :capacity] for a in parts_of(self.keys)))
            self.values = like(self.values, (a[rows, :, :capacity] for a in parts_of(self.values)))

    def parts(self) -> list[mx.array]:
        if self.keys is None:
            return []
        return [*parts_of(self.keys), *parts_of(self.values)]

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*parts_of(self.keys), *parts_of(self.values)))


class QuantizedLayerKV(LayerKV):
    """Keys and values quantized to `bits` in groups of `group_size` along the head dim.
    The two attributes are what sends mlx-lm's attention down its quantized path."""

    def __init__(self, bits: int, group_size: int) -> None:
        super().__init__()
        self.bits = bits
        self.group_size = group_size

    def encode(self, x: mx.array) -> Stored:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))


def _write(stored: Stored, new: Stored, rows: KVRows, t: int) -> Stored:
    """Write the forward's T new rows of every part at each row's positions."""
    parts = zip(parts_of(stored), parts_of(new), strict=True)
    return like(stored, [_write_part(old, part, rows, t) for old, part in parts])


def _write_part(old: mx.array, part: mx.array, rows: KVRows, t: int) -> mx.array:
    """Write one part's T new rows at each row's positions."""
    if rows.uniform_start is not None:  # one contiguous slice for all rows
        s = rows.uniform_start
        old[: part.shape[0], :, s : s + t, :] = part
        return old
    pos = mx.broadcast_to(rows.write_positions[:, None, :, None], part.shape)
    return mx.put_along_axis(old, pos, part, axis=2)


def _grown(stored: Stored | None, new: Stored, capacity: int) -> Stored:
    """Buffers of `capacity` positions shaped like `new`'s parts, keeping what is stored."""
    out = []
    old_parts = parts_of(stored) if stored is not None else (None,) * len(parts_of(new))
    for old, part in zip(old_parts, parts_of(new), strict=True):
        b, h, _, d = part.shape
        grown = mx.zeros((b, h, capacity, d), part.dtype)
        if old is not None:
            grown[:, :, : old.shape[2], :] = old
        out.append(grown)
    return like(new, out)


class KVRows:
    """KV for a fixed number of rows across the layers of one process."""

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        seq_ids: list[int] | None = None,
        kv: KVFormat = FULL,
        states: tuple[int, ...] = (),
    ) -> None:
        """`states[i]`: layer i's recurrent state arrays (0 or absent: attention KV)."""
        self.kv = kv
        self.states = tuple(states) + (0,) * (num_layers - len(states))
        self.layers: list[LayerKV | LayerState] = [
            LayerState(n) if n else self._layer_kv(kv) for n in self.states
        ]
        self.recurrent = any(self.states)
        # Per row, the length its recurrent state has run to (it cannot be taken back:
        # a forward whose rows were not all kept leaves it ahead of `lengths`).
        self.state_at = np.zeros(num_rows, dtype=np.int64)
        self.state_groups: Groups = None  # this forward's rows by width (_begin_states)
        self.lengths = np.zeros(num_rows, dtype=np.int64)  # host copy: no device reads
        # Per row, the end of rows past its length that later forwards still read (a
        # diffusion canvas: a compacted forward reuses the K/V of positions it does not
        # forward). Kept through gathers and shrinks like committed rows.
        self.reserved = np.zeros(num_rows, dtype=np.int64)
        self.seq_ids = list(seq_ids) if seq_ids is not None else list(range(num_rows))
        self.capacity = 0
        self.span = 0
        self.uniform_start: int | None = None
        self.write_positions: mx.array | None = None
        self._starts = np.zeros(num_rows, dtype=np.int64)
        self._width = 0

    @staticmethod
    def _layer_kv(kv: KVFormat) -> LayerKV:
        return LayerKV() if kv.bits is None else QuantizedLayerKV(kv.bits, kv.group_size)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def begin(
        self, windows: np.ndarray | mx.array, widths: np.ndarray | None = None
    ) -> mx.array | str | None:
        """Prepare a forward of `windows` ([rows, T, T] visibilities) at the current lengths;
        `widths`: each row's real slots (None: all T), what recurrent layers take in.

        Returns the attention mask for mlx-lm's layers (None / "causal" when the plain
        causal fast path applies, as in mlx-lm's own generation).
        """
        rows, t = windows.shape[0], windows.shape[-1]
        if rows != self.num_rows:
            raise ValueError(f"forward has {rows} rows, the cache has {self.num_rows}")
        if self.recurrent:
            self._begin_states(np.full(rows, t) if widths is None else np.asarray(widths), t)
        end = int(self.lengths.max()) + t
        if end > self.capacity:
            self.capacity = -(-end // GROW_STEP) * GROW_STEP
        starts = self.lengths
        self._starts, self._width = starts.copy(), t  # for sliding_mask
        on_device = isinstance(windows, mx.array)  # never causal: a look-ahead WeDLM window
        causal = not on_device and np.array_equal(
            windows, np.broadcast_to(np.tri(t, dtype=bool), windows.shape)
        )
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
        windows = windows if on_device else mx.array(windows)
        # a look-ahead WeDLM window (one width, 2W, every step) compiled; other windows
        # vary in width from forward to forward, and each new shape would cost a trace
        build = compiled_attention_mask if on_device else attention_mask
        return build(starts_mx, windows, self.span)

    def _begin_states(self, widths: np.ndarray, t: int) -> None:
        """Group the rows by width for recurrent layers (recurrent_rows.run_state_layer:
        padding never enters a state); a row starting at 0 on an old state (a reused
        padding id) starts from zeros; a row whose state ran past its kept rows fails."""
        ahead = self.state_at != self.lengths
        fresh = ahead & (self.lengths == 0)
        stale = ahead & ~fresh
        if stale.any():
            r = int(np.flatnonzero(stale)[0])
            raise ValueError(
                f"sequence {self.seq_ids[r]}'s recurrent state has run {self.state_at[r]} "
                f"rows but only {self.lengths[r]} were kept: a recurrent state cannot be "
                "rolled back"
            )
        if fresh.any():
            for layer in self.layers:
                if isinstance(layer, LayerState):
                    layer.reset_rows(fresh)
        self.state_groups = width_groups(widths, t)
        self.state_at = self.lengths + np.minimum(widths, t)

    def sliding_mask(
        self, mask: mx.array | str | None, window: int | None, chunk: int | None = None
    ) -> mx.array:
        """`mask` (what `begin` returned) as an array, narrowed to a sliding window of
        `window` positions (None: no window): a query at position p sees keys
        p-window+1..p only, as mlx-lm's RotatingKVCache layers do. With `chunk`, keys of
        p's own chunk only (Llama 4's ChunkedKVCache layers). This cache keeps every
        position; the mask hides the ones that slid out."""
        keys = mx.arange(self.span)[None, None, None, :]
        plain = mask is None or isinstance(mask, str)  # rows alike, plain causal
        starts = self._starts[:1] if plain else self._starts
        queries = mx.array(starts[:, None] + np.arange(self._width)[None, :], mx.int32)
        queries = queries[:, None, :, None]  # [B or 1, 1, T, 1]
        visible = keys <= queries if plain else mask
        if chunk is not None:
            visible = visible & ((queries // chunk) == (keys // chunk))
        return visible if window is None else visible & ((queries - keys) < window)

    def _bind(self, offset: mx.array) -> None:
        for layer in self.layers:
            if isinstance(layer, LayerKV):
                layer.offset = offset
                layer._rows = weakref.ref(self)

    def reserve(self, ends: np.ndarray) -> None:
        """Keep each row's positions up to ends[b] (a canvas written past its length)."""
        self.reserved = np.maximum(self.reserved, ends)

    def commit(self, counts: np.ndarray | list[int]) -> None:
        """Make the first counts[b] rows of the last forward permanent for row b."""
        self.lengths = self.lengths + np.asarray(counts, dtype=np.int64)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (sequences leaving the batch). The capacity
        shrinks to what the longest kept row needs: rows left behind (a prefix cache's
        finished sequences) then cost about their own length, not the batch's."""
        idx = mx.array(rows, dtype=mx.int32)
        self.lengths = self.lengths[rows]
        self.state_at = self.state_at[rows]
        self.reserved = self.reserved[rows]
        self.seq_ids = [self.seq_ids[r] for r in rows]
        longest = int(np.maximum(self.lengths, self.reserved).max()) if len(rows) else 0
        self.capacity = min(self.capacity, max(-(-longest // GROW_STEP), 1) * GROW_STEP)
        for layer in self.layers:
            layer.keep_rows(idx, self.capacity)
        # Computed now: a batch left holding only a prefix cache's rows may not run again
        # for long, and the lazy gather would keep the whole old buffers alive meanwhile.
        mx.async_eval([p for layer in self.layers for p in layer.parts()])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
