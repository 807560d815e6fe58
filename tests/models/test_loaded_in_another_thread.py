"""The server loads a model on its planner thread and runs forwards on its engine thread.
Arrays a module computes at construction and keeps outside its parameters (a YaRN RoPE's
frequencies: gpt-oss, DeepSeek V3, Kimi) must be evaluated at load, or the engine thread
cannot evaluate them ("There is no Stream(cpu, 1) in current thread")."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from common.kv_rows import KVRows
from common.model_parts import load_model_parts, run_layers
from tests.support.checkpoints import make_mlx_checkpoint

YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}


def test_a_yarn_model_loaded_on_one_thread_runs_on_another(tmp_path):
    path = make_mlx_checkpoint(tmp_path / "gpt_oss", "gpt_oss", seed=4, rope_scaling=YARN)
    loaded = {}
    loader = threading.Thread(target=lambda: loaded.update(parts=load_model_parts(path)))
    loader.start()
    loader.join()
    parts = loaded["parts"]
    kv = KVRows(len(parts.layers), 1)
    tokens = mx.array([[5, 17, 99, 3]])
    logits = parts.head(run_layers(parts, parts.embed(tokens), kv, np.tri(4, dtype=bool)[None]))
    mx.eval(logits)  # raised RuntimeError before the load evaluated the held arrays
    assert logits.shape[-1] > 0 and bool(mx.all(mx.isfinite(logits)))
