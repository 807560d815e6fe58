"""KV rows keyed by sequence id. A forward names its sequences; when they are exactly the
rows of an existing batch (the common case: the same decode batch tick after tick) that
batch is used as is, otherwise the rows are gathered into a new batch once. Membership
changes (a sequence joins or leaves) cost one copy, steady decoding costs none."""

from __future__ import annotations

import mlx.core as mx

from common.kv_format import FULL, KVFormat
from common.kv_rows import KVRows, like, parts_of


class KVStore:
    def __init__(self, num_layers: int, kv: KVFormat = FULL) -> None:
        self.num_layers = num_layers
        self.kv = kv
        self.batches: list[KVRows] = []
        self._where: dict[int, KVRows] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._where

    def __len__(self) -> int:
        return len(self._where)

    def length(self, seq_id: int) -> int:
        batch = self._where.get(seq_id)
        return 0 if batch is None else int(batch.lengths[batch.seq_ids.index(seq_id)])

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget a sequence's rows past `length` (they become stale: the next forward
        overwrites them). Only for a process's own speculative rows, never a worker's."""
        batch = self._where.get(seq_id)
        if batch is not None:
            row = batch.seq_ids.index(seq_id)
            batch.lengths[row] = min(int(batch.lengths[row]), length)

    def rows_for(self, seq_ids: list[int]) -> KVRows:
        first = self._where.get(seq_ids[0]) if seq_ids else None
        if first is not None and first.seq_ids == list(seq_ids):
            return first
        batch = self._gather(list(seq_ids))
        for sid in seq_ids:
            self._where[sid] = batch
        self.batches.append(batch)
        return batch

    def release(self, seq_ids: list[int]) -> None:
        for batch in {
            id(self._where[s]): self._where[s] for s in seq_ids if s in self._where
        }.values():
            gone = set(seq_ids)
            self._drop_rows(batch, [i for i, s in enumerate(batch.seq_ids) if s not in gone])
        for s in seq_ids:
            self._where.pop(s, None)

    def _drop_rows(self, batch: KVRows, keep: list[int]) -> None:
        if keep:
            batch.keep_rows(keep)
        else:
            self.batches.remove(batch)

    def _gather(self, seq_ids: list[int]) -> KVRows:
        """A new batch with these rows, in this order; unknown sequences start empty. Per
        layer it costs one concatenation of the source batches and one row gather (not an
        op per row: a batch of 32 rows joined by one sequence is 4 ops a layer, not 64)."""
        new = KVRows(self.num_layers, len(seq_ids), seq_ids, self.kv)
        sources = [self._where.get(s) for s in seq_ids]
        batches = list({id(b): b for b in sources if b is not None}.values())
        new.capacity = max((b.capacity for b in batches), default=0)
        for row, (src, sid) in enumerate(zip(sources, seq_ids, strict=True)):
            if src is not None:
                new.lengths[row] = src.lengths[src.seq_ids.index(sid)]
        for layer in range(self.num_layers):
            stored = [b.layers[layer] for b in batches if b.layers[layer].keys is not None]
            if not stored:
                break  # nothing stored yet: buffers are created on the first write
            for name in ("keys", "values"):
                template = getattr(stored[0], name)
                taken = []
                for i, part in enumerate(parts_of(template)):
                    arrays = [(b, _part(getattr(b.layers[layer], name), i)) for b in batches]
                    taken.append(_take_rows(arrays, sources, seq_ids, part, new.capacity))
                setattr(new.layers[layer], name, like(template, taken))
        # Rows that moved leave their old batches.
        moved = set(seq_ids)
        for src in batches:
            self._drop_rows(src, [i for i, s in enumerate(src.seq_ids) if s not in moved])
        return new


def _part(stored, index: int):
    return None if stored is None else parts_of(stored)[index]


def _take_rows(parts, sources, seq_ids, template: mx.array, capacity: int) -> mx.array:
    """Rows `seq_ids` from the source batches' arrays [rows, heads, capacity, dim] (padded
    to `capacity`), zeros for sequences that have none yet."""
    blocks, at, index = [], {}, 0
    for batch, array in parts:
        if array is None:  # a batch that never ran this layer: its rows are empty
            continue
        if array.shape[2] < capacity:
            array = mx.pad(array, [(0, 0), (0, 0), (0, capacity - array.shape[2]), (0, 0)])
        blocks.append(array)
        at[id(batch)] = index
        index += array.shape[0]
    zero = index  # one row of zeros after the stored rows, for the empty ones
    rows = []
    for src, sid in zip(sources, seq_ids, strict=True):
        if src is None or id(src) not in at:
            rows.append(zero)
        else:
            rows.append(at[id(src)] + src.seq_ids.index(sid))
    if zero in rows:
        shape = (1, template.shape[1], capacity, template.shape[3])
        blocks.append(mx.zeros(shape, template.dtype))
    stacked = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)
    return stacked[mx.array(rows, dtype=mx.int32)]
