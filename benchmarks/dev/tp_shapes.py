"""Shapes and the projection of benchmarks/dev/tp_costs.py: the Qwen3-8B and -32B layer
shapes, a small random qwen3's arguments, one TP rank's block arguments, and the per-token
model of tensor parallelism against a pipeline on Macs (what is assumed is said in it), made
with the formulas `--tp auto` decides with (coordinator/cluster/tp_choice.py)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from coordinator.cluster.tp_choice import (
    break_even_all_reduce_s,
    pipeline_s,
    ring_all_reduce_s,
    tp_stage_s,
)
from devtools.random_checkpoints import QWEN3_HEAD_DIM, QWEN3_SHAPES, QWEN3_VOCAB

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
VOCAB, SHAPES, HEAD_DIM = QWEN3_VOCAB, QWEN3_SHAPES, QWEN3_HEAD_DIM
# Bytes per weight: bf16; mlx 4-bit with a bf16 scale and bias per group of 64.
BYTES_PER_PARAM = {"bf16": 2.0, "4-bit": 0.5 + 4 / 64}
TB5_RDMA_MS = 0.025  # published per all-reduce over Thunderbolt 5 RDMA (jaccl), 2 Macs
IN_FORWARD_MS = 0.15  # all_sum inside a real forward on 2 H200s over NCCL: 0.1-0.25 ms (issue 31)


def small_qwen3_args(layers: int, hidden: int) -> dict[str, Any]:
    """A small qwen3 whose heads (64 wide) and KV heads divide by 2."""
    heads = hidden // 64
    # fmt: off
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
                intermediate_size=3 * hidden, num_attention_heads=heads,
                num_key_value_heads=max(2, heads // 4), head_dim=64, rms_norm_eps=1e-6,
                vocab_size=1024, max_position_embeddings=4096, rope_theta=1e6,
                tie_word_embeddings=False)
    # fmt: on


def block_args(shape: dict[str, int], tp: int) -> dict[str, Any]:
    """One TP rank's block of `shape`: heads, KV heads and MLP columns divided by `tp`
    (the shapes mlx-lm's `shard_linear` leaves on a rank)."""
    # fmt: off
    return dict(model_type="qwen3", hidden_size=shape["hidden"], num_hidden_layers=1,
                intermediate_size=shape["mlp"] // tp, num_attention_heads=shape["heads"] // tp,
                num_key_value_heads=shape["kv_heads"] // tp, head_dim=HEAD_DIM,
                rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=40960,
                rope_theta=1e6, tie_word_embeddings=False)
    # fmt: on


def layer_params(shape: dict[str, int]) -> int:
    h, q, kv = shape["hidden"], shape["heads"] * HEAD_DIM, shape["kv_heads"] * HEAD_DIM
    return 2 * h * q + 2 * h * kv + 3 * h * shape["mlp"]


def _measured_ring(collectives: dict | None, hidden: int) -> float | None:
    """Per all_sum (ms) of a bf16 hidden state in a chain, as measured on loopback."""
    for row in (collectives or {}).get("rows", []):
        if row["message"] == f"hidden {hidden} bfloat16":
            return row["ms_in_chain"]
    return None


def project(bandwidth_gbs: float, hop_ms: float, collectives: dict | None) -> dict[str, Any]:
    """Per-token time of one stream on N Macs: pipeline against TP, for each link."""
    rows = []
    for name, shape in SHAPES.items():
        links = {"TB5 RDMA 25 us (published)": TB5_RDMA_MS,
                 "in-forward 0.15 ms (NCCL, H200)": IN_FORWARD_MS}  # fmt: skip
        ring = _measured_ring(collectives, shape["hidden"])
        if ring is not None:
            links[f"ring TCP loopback {ring * 1e3:.0f} us (measured floor)"] = ring
        n_layers = shape["layers"]
        for weights, bpp in BYTES_PER_PARAM.items():
            layers_ms = n_layers * layer_params(shape) * bpp / bandwidth_gbs / 1e6
            head_ms = VOCAB * shape["hidden"] * bpp / bandwidth_gbs / 1e6
            one_mac = layers_ms + head_ms
            for macs in (2, 4):
                pipeline = pipeline_s(one_mac, macs, hop_ms)
                # The break-even all-reduce, in 2-Mac figures (a ring's N-1 of them).
                even = break_even_all_reduce_s(layers_ms, n_layers, macs, hop_ms)
                breakeven = even / (macs - 1)
                for link, ar2 in links.items():
                    ar = ring_all_reduce_s(ar2 / 2, macs)  # a 2-Mac all-reduce is 2 steps
                    tp = tp_stage_s(layers_ms, n_layers, macs, ar) + head_ms
                    rows.append({
                        "shape": name, "weights": weights, "macs": macs, "link": link,
                        "one_mac_ms": round(one_mac, 2), "pipeline_ms": round(pipeline, 2),
                        "tp_ms": round(tp, 2), "tp_speedup_vs_one_mac": round(one_mac / tp, 2),
                        "winner": "tp" if tp < pipeline else "pipeline",
                        "breakeven_all_reduce_us_2mac_equiv": round(breakeven * 1e3, 1),
                    })  # fmt: skip
    return {
        "bandwidth_GB_s": bandwidth_gbs,
        "rows": rows,
        "measured": "the ring TCP loopback figure only (collectives phase, this host)",
        "assumptions": [
            f"weights are read once per token at {bandwidth_gbs} GB/s (M3 Ultra peak): an "
            "upper bound on speed; compute and KV reads are left out",
            "4-bit = 0.5 B/param + a bf16 scale and bias per 64 weights",
            "lm_head is read whole on every TP rank (mlx-lm's qwen3 shard() splits the layers "
            "only); the embedding is a row lookup",
            f"a pipeline pays {hop_ms} ms per hop, N hops per token (the last stage's token "
            "goes back to the first)",
            "an all-reduce on N Macs costs (N-1) x its 2-Mac figure (a ring's 2(N-1) steps)",
            "TB5 RDMA 25 us per all-reduce as published (exo, jaccl); 0.15 ms is the middle "
            "of the 0.1-0.25 ms seen inside a real forward on 2 H200s over NCCL; the "
            "loopback ring figure is a floor for ring over a real network",
        ],
    }
