"""Quantized KV (--kv-bits): logits close to full-precision KV, memory per token as the
formula says, rows that join and leave batches keep their KV exactly, every stage of a real
cluster stores it alike, and bad settings are refused."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from common.errors import WedlmError
from common.generation_params import GenerationParams
from common.kv_format import KVFormat
from common.layer_runner import LayerRunner
from common.model_config import load_model_config
from common.model_parts import load_model_parts
from common.rows_spec import RowsSpec
from coordinator.engine.local_engine import open_local_engine
from tests.support.cluster_harness import cluster_name, start_coordinator, start_worker, worker_info
from wedlm_client.client import WedlmClient

PROMPTS = ["the cat sat on the mat", "count 1 2 3", "a b a b a", "what is a cluster for"]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("qwen3", seed=91, head_dim=64, num_hidden_layers=3)


def decode_logits(parts, kv: KVFormat, steps: int = 12):
    """Prefill 32 tokens of 2 rows, then `steps` one-token forwards: their logits."""
    runner = LayerRunner(parts, kv)
    ids = mx.array(np.random.default_rng(0).integers(0, 300, (2, 32 + steps)), dtype=mx.int32)
    full = np.ones((2, 32), bool)
    spec = RowsSpec([1, 2], np.zeros(2, np.int64), np.full(2, 32), full, np.full(2, 32))
    runner.forward(spec, parts.embed(ids[:, :32]), validate=False)
    out = []
    for t in range(32, 32 + steps):
        one = np.ones((2, 1), bool)
        spec = RowsSpec([1, 2], np.full(2, t), np.ones(2, np.int64), one, np.ones(2, np.int64))
        out.append(parts.head(runner.forward(spec, parts.embed(ids[:, t : t + 1]), False)))
    return mx.concatenate(out, axis=1), runner


def test_logits_stay_close_and_memory_follows_the_formula(model):
    parts = load_model_parts(model)
    full, full_runner = decode_logits(parts, KVFormat())
    spread = mx.abs(full).max().item()
    for bits, tolerance in ((8, 0.05), (4, 0.5)):
        kv = KVFormat(bits)
        quant, runner = decode_logits(parts, kv)
        error = mx.abs(quant - full).max().item()
        assert error <= tolerance * spread, (bits, error, spread)
        agree = (mx.argmax(quant, -1) == mx.argmax(full, -1)).mean().item()
        print(f"{bits}-bit KV: max logit error {error:.3f} of {spread:.1f}, argmax agree {agree}")
        # buffers hold `capacity` positions per row: bytes follow the per-token formula
        dtype = parts.embed_tokens.weight.dtype
        per_token = kv.bytes_per_token(parts.config, dtype, len(parts.layers))
        capacity = runner.store.batches[0].capacity
        assert runner.kv_bytes() == 2 * capacity * per_token
        ratio = runner.kv_bytes() / full_runner.kv_bytes()
        # float32 model, head dim 64, one group: (64 * bits / 8 + 2 * 4) / (64 * 4)
        assert ratio == pytest.approx((64 * bits / 8 + 8) / 256)


def test_rows_joining_and_leaving_keep_their_quantized_kv(model):
    """Six requests through 3 rows: sequences join and leave batches (their quantized KV is
    gathered and dropped row by row); each output equals its run alone."""
    kv = KVFormat(8)
    local = open_local_engine(model, num_rows=3, kv=kv)
    jobs = [
        (local.tokenizer.encode(t), GenerationParams(mode=m, max_tokens=8 + 5 * i))
        for i, (t, m) in enumerate(zip(PROMPTS + PROMPTS[:2], ["ar", "wedlm"] * 3, strict=True))
    ]
    seqs = [local.engine.submit(p, params) for p, params in jobs]
    for _ in local.engine.stream(seqs):
        pass
    alone = open_local_engine(model, num_rows=1, kv=kv)
    for seq, (prompt, params) in zip(seqs, jobs, strict=True):
        (ref,) = [alone.engine.submit(prompt, params)]
        for _ in alone.engine.stream([ref]):
            pass
        assert seq.output == ref.output


def test_bad_settings_are_refused(model):
    with pytest.raises(WedlmError, match="kv bits must be one of 4, 8"):
        KVFormat(3)
    with pytest.raises(WedlmError, match="kv group size must be one of"):
        KVFormat(8, 48)
    assert not KVFormat(None, 48).quantized  # full precision: the group size is unused
    with pytest.raises(WedlmError, match="does not divide this model's head dimension 64"):
        KVFormat(8, 128).check(load_model_config(model))


def test_every_stage_stores_quantized_kv(model):
    """The coordinator (layer 0) and a worker (layers 1-2) with --kv-bits 8: the worker is
    told by Assign, and the tokens equal the single-process engine with 8-bit KV."""
    name = cluster_name()
    procs = []
    try:
        worker, worker_address = start_worker(model, name, "--no-bonjour")
        procs.append(worker)
        coord, address = start_coordinator(
            model, name, "--no-bonjour", "--worker", worker_address, "--expect", "1",
            "--layers", "0-0", "--kv-bits", "8", "--kv-group-size", "32",
        )  # fmt: skip
        procs.append(coord)
        coord.expect("serving")
        info = worker_info(worker_address, load_model_config(model).identity)
        assert (info.kv_bits, info.kv_group_size) == (8, 32)
        local = open_local_engine(model, kv=KVFormat(8, 32))
        for text in PROMPTS[:2]:
            params = GenerationParams(mode="ar", max_tokens=16)
            seq = local.engine.submit(local.tokenizer.encode(text), params)
            for _ in local.engine.stream([seq]):
                pass
            with WedlmClient(address, timeout=60) as client:
                assert client.generate(text=text, params=params)["tokens"] == seq.output
    finally:
        for p in procs:
            p.stop()
