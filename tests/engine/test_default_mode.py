"""Mode "auto" is the checkpoint's own decoding (issue 25): AR on a plain checkpoint, equal
to mlx-lm's own greedy generation token for token; WeDLM on a WeDLM-trained checkpoint;
and the number of sequences decoded at once when --max-running is not given."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from common.generation_params import GenerationParams
from common.model_config import load_model_config
from coordinator.engine.local_engine import open_local_engine
from coordinator.service.running_limit import AUTO_MAX_RUNNING, auto_max_running
from tests.conftest import shared_model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_auto_on_a_plain_checkpoint_is_mlx_lm_greedy(checkpoint_dir, family):
    path = checkpoint_dir(family, seed=31, wedlm_record=False)
    local = open_local_engine(path)
    assert local.engine.default_mode == "ar"
    prompt = local.tokenizer.encode("the cat sat on the mat and")
    seq = local.engine.submit(prompt, GenerationParams(max_tokens=20))
    for _ in local.engine.stream([seq]):
        pass
    assert seq.params.mode == "ar" and not seq.warning
    model, _ = load(str(path))
    expected = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=20):
        expected.append(int(token))
        if int(token) in local.engine.model_stop_ids:
            break
    assert seq.output == expected


def test_wedlm_on_a_plain_checkpoint_runs_with_a_warning(checkpoint_dir):
    local = open_local_engine(checkpoint_dir("llama", seed=31, wedlm_record=False))
    seq = local.engine.submit([5, 6, 7], GenerationParams(mode="wedlm", max_tokens=4))
    for _ in local.engine.stream([seq]):
        pass
    assert len(seq.output) == 4 and "not WeDLM-trained" in seq.warning
    drafts = local.engine.submit([5, 6, 7], GenerationParams(mode="speculative", draft="mask"))
    assert "mask-slot drafts" in drafts.warning


def test_the_wedlm_trained_checkpoint_defaults_to_wedlm():
    path = shared_model("wedlm-smollm2-135m-r2")
    config = load_model_config(path)
    assert config.wedlm_trained and config.default_mode == "wedlm"
    local = open_local_engine(path)
    prompt = local.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8,")
    seq = local.engine.submit(prompt, GenerationParams(max_tokens=24))
    for _ in local.engine.stream([seq]):
        pass
    assert seq.params.mode == "wedlm" and not seq.warning
    assert len(seq.output) / seq.forwards > 1.5  # parallel commits on counting


def test_max_running_follows_the_measured_memory():
    n, why = auto_max_running(None, 2048, 32)
    assert n == AUTO_MAX_RUNNING and "not measured" in why
    big, why = auto_max_running(10_000_000, 2048, 32)
    assert big == 64 and "largest default" in why
    n, why = auto_max_running(20 * 2592 + 5, 2048, 32)  # room for 20 typical requests
    assert n == 16 and "20 typical requests" in why and "--max-running" in why
    assert auto_max_running(100, 2048, 1)[0] == 1  # not even one: one at a time
