"""KV rows keyed by sequence id. A forward names its sequences; when they are exactly the
rows of an existing batch (the common case: the same decode batch tick after tick) that
batch is used as is, otherwise the rows are gathered into a new batch once. Membership
changes (a sequence joins or leaves) cost one copy, steady decoding costs none."""

from __future__ import annotations

import mlx.core as mx

from common.kv_rows import KVRows


class KVStore:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.batches: list[KVRows] = []
        self._where: dict[int, KVRows] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._where

    def __len__(self) -> int:
        return len(self._where)

    def length(self, seq_id: int) -> int:
        batch = self._where.get(seq_id)
        return 0 if batch is None else int(batch.lengths[batch.seq_ids.index(seq_id)])

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
        """A new batch with these rows, in this order; unknown sequences start empty."""
        new = KVRows(self.num_layers, len(seq_ids), seq_ids=seq_ids)
        sources = [(self._where.get(s), s) for s in seq_ids]
        new.capacity = max([b.capacity for b, _ in sources if b is not None], default=0)
        for b, (src, sid) in enumerate(sources):
            if src is not None:
                new.lengths[b] = src.lengths[src.seq_ids.index(sid)]
        for layer in range(self.num_layers):
            keys, values = [], []
            template = next(
                (
                    src.layers[layer]
                    for src, _ in sources
                    if src and src.layers[layer].keys is not None
                ),
                None,
            )
            if template is None:
                break  # nothing stored yet: buffers are created on the first write
            for src, sid in sources:
                k, v = _row_or_zeros(src, sid, layer, template, new.capacity)
                keys.append(k)
                values.append(v)
            new.layers[layer].keys = mx.concatenate(keys, axis=0)
            new.layers[layer].values = mx.concatenate(values, axis=0)
        # Rows that moved leave their old batches.
        for src in {id(s): s for s, _ in sources if s is not None}.values():
            moved = set(seq_ids)
            self._drop_rows(src, [i for i, s in enumerate(src.seq_ids) if s not in moved])
        return new


def _row_or_zeros(src, sid, layer, template, capacity):
    tk, tv = template.keys, template.values
    if src is None or src.layers[layer].keys is None:
        return (
            mx.zeros((1, tk.shape[1], capacity, tk.shape[3]), tk.dtype),
            mx.zeros((1, tv.shape[1], capacity, tv.shape[3]), tv.dtype),
        )
    row = src.seq_ids.index(sid)
    k = src.layers[layer].keys[row : row + 1]
    v = src.layers[layer].values[row : row + 1]
    if k.shape[2] < capacity:
        pad = capacity - k.shape[2]
        k = mx.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)])
        v = mx.pad(v, [(0, 0), (0, 0), (0, pad), (0, 0)])
    return k, v
