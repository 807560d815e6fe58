"""Loading whole models and layer ranges from checkpoints, and refusing broken ones."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

from common.checkpoint_weights import layer_of
from common.errors import CheckpointError
from common.layer_range import LayerRange
from common.model_parts import load_model_parts
from tests.conftest import shared_model


def _stored_elements(path, wanted) -> int:
    total = 0
    for f in sorted(path.glob("model*.safetensors")):
        total += sum(v.size for k, v in mx.load(str(f)).items() if wanted(k))
    return total


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_layer_ranges_hold_exactly_their_parameters(checkpoint_dir, family):
    path = checkpoint_dir(family, num_hidden_layers=4)
    full = load_model_parts(path)
    ranges = [LayerRange(0, 0), LayerRange(1, 2), LayerRange(3, 3)]
    pieces = [load_model_parts(path, r, with_ends=False) for r in ranges]
    for r, part in zip(ranges, pieces, strict=True):
        assert len(part.layers) == len(r)
        in_range = lambda k, r=r: layer_of(k) is not None and layer_of(k) in r  # noqa: E731
        assert part.num_parameters() == _stored_elements(path, in_range)
        assert not hasattr(part, "embed_tokens")
    non_layer = _stored_elements(path, lambda k: layer_of(k) is None)
    assert full.num_parameters() == sum(p.num_parameters() for p in pieces) + non_layer


def test_range_loading_materializes_only_its_layers(checkpoint_dir):
    path = checkpoint_dir("qwen3", seed=3, num_hidden_layers=8, intermediate_size=512)
    mx.clear_cache()
    before = mx.get_active_memory()
    part = load_model_parts(path, LayerRange(2, 3), with_ends=False)
    used = mx.get_active_memory() - before
    expected = part.num_parameters() * 4  # float32
    assert expected <= used < expected * 1.25 + 65536
    del part


def test_sharded_checkpoint_loads(checkpoint_dir):
    one = load_model_parts(checkpoint_dir("qwen2", seed=4))
    two = load_model_parts(checkpoint_dir("qwen2", seed=4, shards=2))
    assert one.num_parameters() == two.num_parameters()
    x = one.embed(mx.array([[1, 2, 3]]))
    assert mx.array_equal(x, two.embed(mx.array([[1, 2, 3]])))


def test_quantized_checkpoint_matches_mlx_lm():
    """An mlx-lm quantized conversion (round 2: 6-bit, float16 scales) loads and computes
    what mlx-lm computes."""
    path = shared_model("wedlm-smollm2-135m-r2")
    ours = load_model_parts(path)
    ref, _ = mlx_lm_load_model(path)
    ref.set_dtype(mx.float32)
    tokens = mx.array([[1, 9690, 198, 2683, 359, 253]])
    from common.kv_rows import KVRows
    from common.model_parts import run_layers

    kv = KVRows(len(ours.layers), 1)
    hidden = run_layers(ours, ours.embed(tokens), kv, np.tri(6, dtype=bool)[None])
    np.testing.assert_allclose(
        np.array(ours.head(hidden)), np.array(ref(tokens)), rtol=1e-4, atol=1e-4
    )


def _copy(path, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(path, dst)
    return dst


def test_broken_checkpoints_are_refused_clearly(checkpoint_dir, tmp_path):
    good = checkpoint_dir("qwen3", seed=5)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_parts(tmp_path / "nowhere")

    d = _copy(good, tmp_path / "a")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_model_parts(d)

    d = _copy(good, tmp_path / "b")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model_parts(d)

    d = _copy(good, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_family"}))
    with pytest.raises(CheckpointError, match="unsupported model_type 'no_such_family'"):
        load_model_parts(d)

    d = _copy(good, tmp_path / "d")
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": -3}))
    with pytest.raises(CheckpointError, match="hidden_size must be a positive integer"):
        load_model_parts(d)

    d = _copy(good, tmp_path / "e")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_model_parts(d)

    d = _copy(good, tmp_path / "f")
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model_parts(d)

    d = _copy(good, tmp_path / "g")
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="weights do not match"):
        load_model_parts(d)

    with pytest.raises(CheckpointError, match="past the model's 2 layers"):
        load_model_parts(good, LayerRange(1, 2), with_ends=False)


def test_chunked_graph_launches_change_nothing(checkpoint_dir, monkeypatch):
    """Launching the layer graph in chunks (the device starts early) gives the same hidden
    states and the same committed KV as one launch at the end."""
    from common import model_parts
    from common.kv_rows import KVRows
    from common.window_mask import window_visibility

    parts = load_model_parts(checkpoint_dir("qwen3", seed=5, num_hidden_layers=7))
    tokens = mx.array([[3, 9, 27, 81, 20], [5, 6, 7, 8, 9]])
    windows = np.stack([window_visibility(np.array([True, True, False, True, False]))] * 2)
    outs, keys = [], []
    for every in (0, 2, 3):
        monkeypatch.setattr(model_parts, "LAUNCH_EVERY", every)
        kv = KVRows(len(parts.layers), 2)
        out = model_parts.run_layers(parts, parts.embed(tokens), kv, windows)
        mx.eval(out)
        outs.append(np.array(out))
        keys.append([np.array(layer.keys) for layer in kv.layers])
    for out, ks in zip(outs[1:], keys[1:], strict=True):
        np.testing.assert_array_equal(out, outs[0])
        for k, k0 in zip(ks, keys[0], strict=True):
            np.testing.assert_array_equal(k, k0)
