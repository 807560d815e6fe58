"""The files a coordinator serves to fetching workers (one safetensors file per layer, cut
from the checkpoint's own files) and the worker's cache folder of them."""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import time

import mlx.core as mx
import numpy as np
import pytest

import coordinator.model_source.layer_files as layer_files
from common.checkpoint_weights import layer_file_name, load_tensors
from common.layer_range import LayerRange
from common.model_parts import load_model_parts
from coordinator.model_source.layer_files import LayerFiles
from shard_worker.layer_cache import CacheFull, LayerCache


def _write_layers(files: LayerFiles, folder, layers) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for layer in layers:
        data = b"".join(chunk for _, chunk in files.chunks(layer))
        (folder / layer_file_name(layer)).write_bytes(data)


@pytest.mark.parametrize("family, shards", [("wedlm_qwen3", 1), ("qwen3", 3), ("qwen3_moe", 2)])
def test_each_layer_file_holds_exactly_that_layers_tensors(
    checkpoint_dir, tmp_path, monkeypatch, family, shards
):
    model = checkpoint_dir(family, seed=81, num_hidden_layers=3, shards=shards)
    monkeypatch.setattr(layer_files, "CHUNK", 4096)  # many chunks, crossing tensors
    files = LayerFiles(model, 3)
    for layer in range(3):
        chunks = list(files.chunks(layer))
        body = b"".join(c for _, c in chunks)
        assert len(body) == files[layer].size
        assert all(0 < len(c) <= 4096 for _, c in chunks)
        offsets = [o for o, _ in chunks]
        assert offsets == [0, *itertools.accumulate(len(c) for _, c in chunks[:-1])]
        header_len = int.from_bytes(body[:8], "little")
        assert (8 + header_len) % 8 == 0  # the data starts aligned
        assert files.sha256(layer) == hashlib.sha256(body).hexdigest()
        for offset in (1, 4095, 4096, 9000, len(body) - 1, len(body)):
            assert b"".join(c for _, c in files.chunks(layer, offset)) == body[offset:]
        path = tmp_path / f"{family}-{layer}.safetensors"
        path.write_bytes(body)
        served = mx.load(str(path))
        prefix = f"model.layers.{layer}."
        source = load_tensors(model, lambda k, p=prefix: k.startswith(p))
        assert sorted(served) == sorted(source) and source
        for name, value in source.items():
            assert served[name].dtype == value.dtype
            assert np.array_equal(np.array(served[name]), np.array(value))


def test_a_cache_folder_of_layer_files_loads_like_the_checkpoint(checkpoint_dir, tmp_path):
    model = checkpoint_dir("qwen3", seed=82, num_hidden_layers=4, shards=2)
    folder = tmp_path / "cache"
    _write_layers(LayerFiles(model, 4), folder, [1, 2, 3])
    shutil.copyfile(model / "config.json", folder / "config.json")
    fetched = load_model_parts(folder, LayerRange(1, 2), with_ends=False)
    original = load_model_parts(model, LayerRange(1, 2), with_ends=False)
    a = dict(_flat(fetched.parameters()))
    b = dict(_flat(original.parameters()))
    assert a.keys() == b.keys()
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def _model_folder(cache: LayerCache, identity: str, layers: dict[int, int]) -> None:
    folder = cache.model_dir(identity)
    folder.mkdir(parents=True, exist_ok=True)
    for layer, size in layers.items():
        (folder / layer_file_name(layer)).write_bytes(b"\0" * size)


def test_room_is_made_from_the_least_recently_used_model_then_unneeded_layers(tmp_path):
    cache = LayerCache(tmp_path, max_bytes=10_000)
    _model_folder(cache, "aaaa", {0: 3000})
    _model_folder(cache, "bbbb", {0: 3000})
    _model_folder(cache, "cccc", {0: 1000, 1: 1000, 2: 1000})
    old = time.time() - 100
    os.utime(cache.model_dir("aaaa"), (old, old))  # aaaa was used least recently
    cache.make_room("cccc", LayerRange(1, 2), range_bytes=2000, need=2500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bbbb", "cccc"]
    cache.make_room("cccc", LayerRange(1, 2), range_bytes=2000, need=6500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cccc"]
    cache.make_room("cccc", LayerRange(1, 2), range_bytes=2000, need=7500)
    assert sorted(cache.cached_layers("cccc")) == [1, 2]  # layer 0 is not in the range
    with pytest.raises(CacheFull, match="more than the cache's cap"):
        cache.make_room("cccc", LayerRange(0, 2), range_bytes=20_000, need=18_000)


def test_without_a_cap_only_the_model_in_use_is_kept(tmp_path):
    cache = LayerCache(tmp_path)
    _model_folder(cache, "aaaa", {0: 100})
    _model_folder(cache, "bbbb", {0: 100, 5: 100})
    cache.make_room("bbbb", LayerRange(0, 0), range_bytes=100, need=10)
    assert [p.name for p in tmp_path.iterdir()] == ["bbbb"]
    assert sorted(cache.cached_layers("bbbb")) == [0, 5]  # its own layers stay while they fit
    with pytest.raises(CacheFull, match="not enough disk space"):
        cache.make_room("bbbb", LayerRange(0, 0), range_bytes=100, need=1 << 60)
    assert sorted(cache.cached_layers("bbbb")) == [0, 5]  # refused before removing anything
    assert cache.clear() == 200 and not list(tmp_path.iterdir())


def test_a_changed_file_no_longer_matches_its_checksum(tmp_path):
    cache = LayerCache(tmp_path)
    _model_folder(cache, "aaaa", {0: 1000})
    path = cache.layer_path("aaaa", 0)
    good = hashlib.sha256(path.read_bytes()).hexdigest()
    assert cache.matches(path, good)
    path.write_bytes(b"\1" + b"\0" * 999)  # same size, other bytes
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert not cache.matches(path, good)
    with pytest.raises(Exception, match="invalid model identity"):
        cache.model_dir("../etc")
