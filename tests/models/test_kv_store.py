"""KVStore regathers rows when a batch's membership changes: every row keeps its keys,
values and length, whichever batch it came from and whatever that batch's capacity; new
sequences start empty."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.kv_rows import KVRows
from common.kv_store import KVStore

H, D = 2, 4


def _filled(store: KVStore, seq_ids: list[int], capacity: int, seed: int) -> KVRows:
    batch = store.rows_for(seq_ids)
    batch.capacity = capacity
    for i, layer in enumerate(batch.layers):
        key = mx.random.key(seed * 10 + i)
        layer.keys = mx.random.normal((len(seq_ids), H, capacity, D), key=key)
        layer.values = layer.keys + 1
    batch.lengths = np.arange(len(seq_ids), dtype=np.int64) + seed
    return batch


def test_rows_keep_their_kv_across_regathering():
    store = KVStore(num_layers=2)
    a = _filled(store, [1, 2, 3], capacity=256, seed=1)
    b = _filled(store, [7, 8], capacity=512, seed=2)
    want = {
        sid: (
            [np.array(layer.keys[r]) for layer in batch.layers],
            [np.array(layer.values[r]) for layer in batch.layers],
            int(batch.lengths[r]),
        )
        for batch in (a, b)
        for r, sid in enumerate(batch.seq_ids)
    }
    merged = store.rows_for([8, 2, 99, 1])  # from two batches, and one new sequence
    assert merged.seq_ids == [8, 2, 99, 1] and merged.capacity == 512
    for row, sid in enumerate(merged.seq_ids):
        for i, layer in enumerate(merged.layers):
            got_k, got_v = np.array(layer.keys[row]), np.array(layer.values[row])
            if sid == 99:
                assert not got_k.any() and not got_v.any()
                continue
            keys, values, _ = want[sid]
            cap = keys[i].shape[1]
            np.testing.assert_array_equal(got_k[:, :cap], keys[i])
            np.testing.assert_array_equal(got_v[:, :cap], values[i])
            assert not got_k[:, cap:].any()  # padded to the larger capacity
        assert store.length(sid) == (0 if sid == 99 else want[sid][2])
    # the rows left behind stay where they were; the moved ones left their batches
    assert store.rows_for([3]).seq_ids == [3] and store.length(3) == want[3][2]
    assert store.rows_for([7]).seq_ids == [7] and store.length(7) == want[7][2]
    assert len(store) == 6
