"""benchmarks/dev/tp_costs.py's collectives phase: two real processes joined by MLX's
`ring` backend on 127.0.0.1 sum a hidden state, and the projection built from it."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.dev.tp_costs import collectives_phase, handoff_phase, parse_args
from benchmarks.dev.tp_shapes import SHAPES, project


def tiny_args() -> argparse.Namespace:
    return parse_args(["--repeats", "5", "--chain", "4", "--hiddens", "4096",
                       "--dtypes", "bfloat16", "--kib", "4"])  # fmt: skip


def test_ring_all_sum_between_two_processes_and_projection() -> None:
    res = collectives_phase(tiny_args())
    assert res["group_size"] == 2
    rows = {r["message"]: r for r in res["rows"]}
    assert set(rows) == {"hidden 4096 bfloat16", "4 KiB float32"}
    assert rows["hidden 4096 bfloat16"]["bytes"] == 4096 * 2
    assert rows["4 KiB float32"]["bytes"] == 4096
    assert all(0 < r["ms_one"] < 1000 and 0 < r["ms_in_chain"] < 1000 for r in rows.values())
    (tok,) = res["per_token_tp2"]  # only the 8B shape has hidden 4096
    assert tok["shape"] == "qwen3-8b" and tok["all_reduces"] == 2 * SHAPES["qwen3-8b"]["layers"]

    proj = project(819.0, 0.4, res)
    measured = [r for r in proj["rows"] if "measured" in r["link"]]
    assert {r["shape"] for r in measured} == {"qwen3-8b"}  # 32B's hidden was not measured
    for r in proj["rows"]:
        assert r["winner"] == ("tp" if r["tp_ms"] < r["pipeline_ms"] else "pipeline")
        assert r["pipeline_ms"] > r["one_mac_ms"]  # a pipeline never speeds one stream up


def test_flags_are_checked() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--shard-hidden", "200"])


def test_handoff_moves_a_hidden_state_both_ways() -> None:
    """ring send/recv between two processes and the gRPC relay hop to a real server process
    carry the same bf16 hidden state; both figures are one-way times."""
    args = parse_args(["--phases", "handoff", "--repeats", "3",
                       "--handoff-messages", "decode 1 x 4096"])  # fmt: skip
    res = handoff_phase(args)
    (row,) = res["rows"]
    assert row["message"] == "decode 1 x 4096" and row["bytes"] == 4096 * 2
    assert 0 < row["ring_ms"] < 1000 and 0 < row["grpc_ms"] < 1000
    assert row["intact"]  # both ways, the array that came back is the one sent
    assert row["faster"] == ("ring send/recv" if row["ring_ms"] < row["grpc_ms"] else "gRPC relay")
    with pytest.raises(SystemExit):
        parse_args(["--handoff-messages", "decode 1 x 3"])
