"""KV rows keyed by sequence id. A forward names its sequences; when they are exactly the
rows of an existing batch (the common case: the same decode batch tick after tick) that
batch is used as is, otherwise the rows are gathered into a new batch once. Membership
changes (a sequence joins or leaves) cost one copy, steady decoding costs none.

A sequence may start as a fork of another's rows (a prefix-cache hit: the coordinator
keeps finished sequences' rows and names the one to copy). The fork is only recorded;
the copy happens in the same gather that brings the new sequence into its first batch,
so it costs nothing extra."""

from __future__ import annotations

import mlx.core as mx

from common.kv_format import FULL, KVFormat
from common.kv_rows import KVRows, like, parts_of
from common.recurrent_rows import gather_states


class KVStore:
    def __init__(self, num_layers: int, kv: KVFormat = FULL, states: tuple[int, ...] = ()) -> None:
        """`states[i]`: layer i's recurrent state arrays (0 or absent: attention KV)."""
        self.num_layers = num_layers
        self.kv = kv
        self.states = tuple(states)
        self.batches: list[KVRows] = []
        self._where: dict[int, KVRows] = {}
        self._forks: dict[int, tuple[int, int]] = {}  # new sequence -> (source, length)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._where or seq_id in self._forks

    def __len__(self) -> int:
        return len(self._where) + len(self._forks)

    def length(self, seq_id: int) -> int:
        if seq_id in self._forks:
            return self._forks[seq_id][1]
        batch = self._where.get(seq_id)
        return 0 if batch is None else int(batch.lengths[batch.seq_ids.index(seq_id)])

    def fork_problem(self, seq_id: int, source: int, length: int) -> str | None:
        """Why `seq_id` cannot start from `source`'s first `length` rows (None: it can)."""
        if seq_id in self:
            return f"sequence {seq_id} already has KV here: only a new sequence can fork"
        if source not in self._where:
            return f"fork source {source} is not here (its KV was released)"
        have = self.length(source)
        if not 0 < length <= have:
            return f"fork of {length} rows from sequence {source}, which holds {have}"
        if any(self.states):
            batch = self._where[source]
            at = int(batch.state_at[batch.seq_ids.index(source)])
            if length != at:  # a state summarises every row it ran: no shorter prefix
                return (
                    f"fork of {length} rows from sequence {source}, whose recurrent state "
                    f"holds {at}: a recurrent state forks only at its own length"
                )
        return None

    def fork(self, seq_id: int, source: int, length: int) -> None:
        """Let new sequence `seq_id` start with `source`'s first `length` rows."""
        problem = self.fork_problem(seq_id, source, length)
        if problem is not None:
            raise ValueError(problem)
        self._forks[seq_id] = (source, length)

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget a sequence's rows past `length` (they become stale: the next forward
        overwrites them). Only for a process's own speculative rows, never a worker's."""
        batch = self._where.get(seq_id)
        if batch is not None:
            row = batch.seq_ids.index(seq_id)
            batch.lengths[row] = min(int(batch.lengths[row]), length)

    def extend(self, seq_ids: list[int], counts: list[int]) -> None:
        """Make `counts` more rows of each sequence permanent: rows its last forward wrote
        past its length, kept once the forward's launcher knows how many (wedlm_ahead.py)."""
        for sid, count in zip(seq_ids, counts, strict=True):
            batch = self._where.get(sid)
            if batch is not None and count:
                batch.lengths[batch.seq_ids.index(sid)] += count

    def rows_for(self, seq_ids: list[int]) -> KVRows:
        first = self._where.get(seq_ids[0]) if seq_ids else None
        if first is not None and first.seq_ids == list(seq_ids):
            return first
        batch = self._gather(list(seq_ids))
        for sid in seq_ids:
            self._where[sid] = batch
            self._forks.pop(sid, None)
        self.batches.append(batch)
        return batch

    def release(self, seq_ids: list[int]) -> None:
        gone = set(seq_ids)
        for sid in gone & self._forks.keys():
            del self._forks[sid]
        waiting = [sid for sid, (src, _) in self._forks.items() if src in gone]
        if waiting:  # their source leaves: copy their rows out first
            self.rows_for(waiting)
        for batch in {
            id(self._where[s]): self._where[s] for s in seq_ids if s in self._where
        }.values():
            self._drop_rows(batch, [i for i, s in enumerate(batch.seq_ids) if s not in gone])
        for s in seq_ids:
            self._where.pop(s, None)

    def _drop_rows(self, batch: KVRows, keep: list[int]) -> None:
        if keep:
            batch.keep_rows(keep)
        else:
            self.batches.remove(batch)

    def _source(self, seq_id: int) -> tuple[KVRows, int, int] | None:
        """Where a sequence's rows come from: (batch, row, length), None if it has none."""
        source, length = self._forks.get(seq_id, (seq_id, None))
        batch = self._where.get(source)
        if batch is None:
            return None
        row = batch.seq_ids.index(source)
        return batch, row, int(batch.lengths[row]) if length is None else length

    def _gather(self, seq_ids: list[int]) -> KVRows:
        """A new batch with these rows, in this order; unknown sequences start empty and
        forks start as a copy of their source's row. Per layer it costs one concatenation
        of the source batches and one row gather (not an op per row: a batch of 32 rows
        joined by one sequence is 4 ops a layer, not 64)."""
        new = KVRows(self.num_layers, len(seq_ids), seq_ids, self.kv, self.states)
        found = [self._source(s) for s in seq_ids]
        sources = [(f[0], f[1]) if f is not None else None for f in found]
        batches = list({id(f[0]): f[0] for f in found if f is not None}.values())
        new.capacity = max((b.capacity for b in batches), default=0)
        for row, (sid, f) in enumerate(zip(seq_ids, found, strict=True)):
            if f is not None:
                new.lengths[row] = f[2]
                # a fork's state is its source's, at the fork's length (fork_problem)
                new.state_at[row] = f[0].state_at[f[1]] if sid not in self._forks else f[2]
                if sid not in self._forks:  # a moved row keeps its reserved positions
                    new.reserved[row] = f[0].reserved[f[1]]
        for layer in range(self.num_layers):
            if new.states[layer]:  # a recurrent layer: its state rows, not positions
                held = [(id(b), b.layers[layer]) for b in batches]
                rows = [None if x is None else (id(x[0]), x[1]) for x in sources]
                new.layers[layer].cache = gather_states(held, rows, new.states[layer])
                continue
            stored = [b.layers[layer] for b in batches if b.layers[layer].keys is not None]
            if not stored:
                continue  # nothing stored yet: buffers are created on the first write
            for name in ("keys", "values"):
                template = getattr(stored[0], name)
                taken = []
                for i, part in enumerate(parts_of(template)):
                    arrays = [(b, _part(getattr(b.layers[layer], name), i)) for b in batches]
                    taken.append(_take_rows(arrays, sources, part, new.capacity))
                setattr(new.layers[layer], name, like(template, taken))
        # Rows that moved leave their old batches (a fork's source stays where it is).
        moved = {s for s in seq_ids if s in self._where}
        for src in batches:
            self._drop_rows(src, [i for i, s in enumerate(src.seq_ids) if s not in moved])
        return new


def _part(stored, index: int):
    return None if stored is None else parts_of(stored)[index]


def _take_rows(parts, sources, template: mx.array, capacity: int) -> mx.array:
    """Rows `sources` ((batch, row) each, or None) from the source batches' arrays
    [rows, heads, capacity, dim] (padded to `capacity`), zeros for sequences that have
    none yet."""
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
    for src in sources:
        if src is None or id(src[0]) not in at:
            rows.append(zero)
        else:
            rows.append(at[id(src[0])] + src[1])
    if zero in rows:
        shape = (1, template.shape[1], capacity, template.shape[3])
        blocks.append(mx.zeros(shape, template.dtype))
    stacked = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)
    return stacked[mx.array(rows, dtype=mx.int32)]
