"""devtools/random_checkpoints.py, the one writer of random checkpoints of real shapes that
benchmarks/dev/ uses: a shrunk gpt-oss (mxfp4 experts, as mlx-community ships it) that
mlx-lm loads and runs, whose every id decodes, reused when complete; the CLI's refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from devtools.random_checkpoints import write_random_family
from tests.support.paths import REPO_ROOT


def test_a_shrunk_quantized_family_loads_decodes_and_is_reused(tmp_path: Path) -> None:
    from mlx_lm import load

    path = write_random_family(
        tmp_path / "goss", "gpt-oss-20b", 2, bits=4, mode="mxfp4", shrink=True
    )
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["quantization"]["mode"] == "mxfp4"
    assert config["eos_token_id"] == config["vocab_size"] - 1  # <|im_end|>, the specials at the end
    model, tok = load(str(path))
    assert tok.decode(tok.encode("w5 w7")).split() == ["w5", "w7"]
    logits = model(mx.array([[5, 7, 9]]))
    assert logits.shape == (1, 3, config["vocab_size"]) and bool(mx.isfinite(logits).all())
    stamp = {f.name: f.stat().st_mtime_ns for f in path.glob("*.safetensors")}
    write_random_family(tmp_path / "goss", "gpt-oss-20b", 2, bits=4, mode="mxfp4", shrink=True)
    assert {f.name: f.stat().st_mtime_ns for f in path.glob("*.safetensors")} == stamp


def test_the_cli_refuses_bits_for_a_qwen3_shape_in_one_line(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "devtools.random_checkpoints", "--shape", "qwen3-8b",
            "--bits", "4", "--out", str(tmp_path / "q")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 2 and not (tmp_path / "q").exists()
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("--shape qwen3-8b: bf16 at its own widths (--bits, --shrink: another shape)")
    )
