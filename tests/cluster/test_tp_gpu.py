"""benchmarks/dev/tp_gpu.py on this CPU: the random checkpoint writer, mlx-lm under
`mlx.launch --backend ring` on 127.0.0.1 (the phases mlxlm and profile, a tiny qwen3), the
template cluster's failure message, and the process groups that stop what mlx.launch
started."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from benchmarks.dev.tp_gpu import main, parse_args
from benchmarks.dev.tp_gpu_servers import TemplateCluster
from benchmarks.dev.tp_shapes import small_qwen3_args
from devtools.cluster_harness import free_port, spawn_command
from devtools.random_checkpoints import (
    qwen3_config,
    qwen3_shape,
    word_tokenizer,
    write_random_qwen3,
)


def test_random_checkpoint_shapes_and_a_tiny_one_loads(tmp_path: Path) -> None:
    big = qwen3_config(qwen3_shape("qwen3-32b"))
    assert (big["hidden_size"], big["num_hidden_layers"], big["intermediate_size"]) == (
        5120, 64, 25600,
    )  # fmt: skip
    assert (big["num_attention_heads"], big["num_key_value_heads"], big["head_dim"]) == (64, 8, 128)
    path = write_random_qwen3(tmp_path / "m", 1, 256, shape="qwen3-32b")
    from mlx_lm import load

    model, tok = load(str(path))
    assert model.args.num_hidden_layers == 1 and model.args.hidden_size == 256
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert tok.decode(tok.encode("w5 w7")).split() == ["w5", "w7"]
    logits = model(mx.array([[5, 7, 9]]))
    assert logits.shape == (1, 3, 151936) and bool(mx.isfinite(logits).all())


def _tiny_checkpoint(out: Path) -> Path:
    """A small-vocabulary qwen3 that shards by 2 (4 heads, 2 KV heads), bf16."""
    from mlx_lm.models import qwen3

    args = small_qwen3_args(2, 256)
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs(**args))
    weights = {k: (v * 0.5).astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps({**args, "eos_token_id": 0}))
    word_tokenizer(out, args["vocab_size"])
    return out


@pytest.mark.e2e
def test_mlxlm_and_profile_phases_over_ring(tmp_path: Path) -> None:
    model = _tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "out"
    main(["mlxlm", "profile", "--model", str(model), "--backend", "ring", "--tokens", "8",
          "--batch", "2", "--prefill", "40", "--prompt", "8", "--repeats", "1", "--context", "16",
          "--steps", "2", "--collective-repeats", "3", "--out", str(out)])  # fmt: skip
    result = json.loads((out / "tp_gpu-mlxlm-profile.json").read_text())
    assert (out / "tp_gpu-mlxlm-profile.png").stat().st_size > 0
    runs = result["mlxlm"]["runs"]
    assert runs["one"]["tp"] == 1 and runs["tp2"]["tp"] == 2  # really a group of two
    for what in ("decode", "batch", "prefill"):
        side = result["mlxlm"]["side_by_side"][what]
        assert side["one_tok_s"] > 0 and side["tp_tok_s"] > 0
        assert side["tp_over_one"] == round(side["tp_tok_s"] / side["one_tok_s"], 3)
    assert runs["tp2"]["prefill"]["prompt"] == 40 and runs["one"]["batch"]["concurrency"] == 2
    prof = result["profile"]
    assert prof["tpN"]["all_sums_per_forward"] == 4  # o_proj and down_proj of 2 layers
    assert prof["tpN"]["all_sum_alone"]["chain"] == 4
    split = prof["split"]
    assert split["tp_step_ms"] > 0 and split["tp_compute_alone_ms"] > 0
    assert split["tp_collectives_in_step_ms"] == round(
        split["tp_step_ms"] - split["tp_compute_alone_ms"], 3
    )


def test_a_cluster_command_that_never_gets_ready_is_reported(tmp_path: Path) -> None:
    server = TemplateCluster("ours", [], free_port(), "/health/ready", ready_timeout=30,
                             templates=["{python} -c 'import sys; sys.exit(3)'", "{python} -V"],
                             fields={"python": "python3"})  # fmt: skip
    with pytest.raises(RuntimeError, match="did not print 'listening on'"):
        server.start(timeout=30)
    assert server.others and server.others[0].popen.poll() == 3


def test_a_group_stop_ends_what_the_launcher_started() -> None:
    proc = spawn_command(["bash", "-c", "sleep 300 & echo child $!; wait"], group=True)
    child = int(proc.expect(r"child (\d+)").group(1))
    proc.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the launcher's child {child} outlived stop()")


def test_flags_are_checked(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent")
    for bad in (["mlxlm", "--tp", "1"], ["servers", "--servers", "ours,vllm"],
                ["mlxlm", "--model", absent], ["profile", "--steps", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)
    args = parse_args(["servers", "--model", "random-qwen3-32b", "--ours", "tp2"])
    assert args.servers == ["ours", "mlx-lm"] and args.concurrency == [1, 32]


@pytest.mark.e2e
def test_group_trace_over_ring(tmp_path: Path, capsys) -> None:
    """benchmarks/dev/tp_group_trace.py: two real group processes (ring on 127.0.0.1)
    against the same layers in one process, with the leader's split of each forward."""
    from benchmarks.dev import tp_group_trace

    model = _tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "out"
    assert tp_group_trace.main(["--model", str(model), "--rows", "1", "2", "--steps", "3",
                                "--warmup", "1", "--context", "8", "--prefill", "16",
                                "--head", "64", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads((out / "tp_group_trace.json").read_text())
    assert result["group"]["backend"] == "ring"
    for key in ("B=1", "B=2"):
        group = result["group"][key]
        assert group["round_trip_ms"] > 0 and group["eval_ms"] > 0 and group["head_ms"] > 0
        assert group["pipe_ms"] >= 0  # each forward's split lies within its round trip
        assert result["one"][key]["step_ms"] > 0 and result["group_vs_one"][key] > 0
    assert result["group"]["prefill_ms"] > 0 and result["prefill_one_vs_group"] > 0
    assert set(result["group"]["prefill_split_ms"]) == {"share_ms", "build_ms", "eval_ms",
                                                        "readback_ms"}  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
