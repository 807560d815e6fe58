"""Tests of the test infrastructure: the checkpoint factory and the PyTorch WeDLM reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.support.checkpoints import FAMILIES, make_checkpoint
from tests.support.reference_wedlm import (
    Window,
    _forward,
    adjusted_fills,
    causal_mask_4d,
    load_model,
    reference_generate,
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {fam: make_checkpoint(root / fam, fam, seed=0) for fam in FAMILIES}


def _prompt(ckpt: Path, text: str = "count to five") -> list[int]:
    tok = AutoTokenizer.from_pretrained(ckpt)
    msgs = [{"role": "user", "content": text}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def test_worked_example_w4() -> None:
    """Replays the spec's W=4 table with symbolic tokens; L is the committed length at step 1."""
    L = 10
    win = Window.of_masks(4, "M")
    assert win.refill("M") == 0
    assert win.rows(L)[:2] == (["M"] * 4, [L, L + 1, L + 2, L + 3])
    win.fill(0, "a")
    win.fill(2, "c")
    assert win.tok == ["a", "M", "c", "M"]

    assert win.refill("M") == 1
    assert win.tok == ["a", "M", "c", "M", "M"]
    toks, pos, slots = win.rows(L)
    assert (toks, pos, slots) == (
        ["a", "c", "M", "M", "M"],
        [L, L + 2, L + 1, L + 3, L + 4],
        [0, 2, 1, 3, 4],
    )
    assert win.pop_front(1) == ["a"]
    assert win.tok == ["M", "c", "M", "M"]  # d counts from here: first remaining mask has d = 0
    win.fill(0, "b")
    win.fill(3, "e")

    C = L + 1
    assert win.refill("M") == 2
    toks, pos, _ = win.rows(C)
    assert toks == ["b", "c", "e", "M", "M", "M"]
    assert pos == [C, C + 1, C + 3, C + 2, C + 4, C + 5]
    assert win.pop_front(2) == ["b", "c"]
    assert win.is_mask == [True, False, True, True]


def test_window_tracks_masks_by_flag() -> None:
    win = Window.of_masks(3, 7)
    win.fill(0, 7)  # the model may predict the mask id itself: it is still a filled slot
    assert win.leading_filled() == 1 and win.physical_order() == [0, 1, 2]


def test_selection_rule() -> None:
    assert adjusted_fills([0, 1, 2], [0.3, 0.39, 0.1], 0.02, 0.4) == [
        0,
        2,
    ]  # 0.39 + 0.02 is not < 0.4
    assert adjusted_fills([0, 5], [0.3, 0.3], 0.02, 0.4) == [0]  # the penalty counts window index d
    assert adjusted_fills([0, 3], [2.0, 1.0], 0.5, 0.4) == [
        0
    ]  # none qualifies: argmin of 2.0 vs 2.5
    assert adjusted_fills([0, 1], [0.4, 0.0], 0.0, 0.4) == [1]  # strict: 0.4 is not < 0.4
    assert adjusted_fills([1, 2], [0.1, 0.1], 0.02, None) == [1]  # one-by-one mode


def test_4d_mask_is_honoured(ckpts: dict[str, Path]) -> None:
    model = load_model(ckpts["wedlm_qwen3"])
    ids = _prompt(ckpts["wedlm_qwen3"])
    n = len(ids)
    plain = _forward(model, ids)
    assert torch.allclose(_forward(model, ids, list(range(n))), plain, atol=1e-5)
    # a deliberately wrong (bidirectional) mask must change the logits of early rows
    kwargs = {
        "input_ids": torch.tensor([ids]),
        "position_ids": torch.arange(n)[None],
        "use_cache": False,
    }
    with torch.no_grad():
        wrong = model(**kwargs, attention_mask=torch.zeros(1, 1, n, n)).logits[0]
    assert not torch.allclose(wrong, plain, atol=1e-3)
    # a boolean 4-D mask is taken too (True = attend) and agrees with the additive one
    with torch.no_grad():
        boolean = model(**kwargs, attention_mask=causal_mask_4d(n) == 0).logits[0]
    assert torch.allclose(boolean, plain, atol=1e-5)


def test_reordered_rows_equal_natural_order_with_rank_mask(ckpts: dict[str, Path]) -> None:
    """Physical order + causal mask is the same math as logical order + a mask built from ranks."""
    model = load_model(ckpts["wedlm_qwen3"])
    cfg = _config(ckpts["wedlm_qwen3"])
    ctx = _prompt(ckpts["wedlm_qwen3"])
    C, m = len(ctx), cfg["mask_token_id"]
    win = Window([5, m, 9, m, 11, m], [False, True, False, True, False, True])
    toks, pos, slots = win.rows(C)
    phys = _forward(model, ctx + toks, list(range(C)) + pos)
    rank = {s: r for r, s in enumerate(slots)}
    n = C + len(slots)
    see = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(len(slots)):
        for j in range(len(slots)):
            see[C + i, C + j] = rank[j] <= rank[i]
    bias = torch.zeros(n, n).masked_fill(~see, torch.finfo(torch.float32).min)[None, None]
    kwargs = {"input_ids": torch.tensor([ctx + win.tok]), "position_ids": torch.arange(n)[None]}
    with torch.no_grad():
        natural = model(**kwargs, attention_mask=bias, use_cache=False).logits[0]
    for s in slots:
        assert torch.allclose(phys[C + rank[s]], natural[C + s], atol=1e-4)
    # with neither an explicit mask nor a cache, transformers reads non-monotonic positions as
    # packed sequences (a new sequence wherever the position does not grow by 1)
    kwargs = {
        "input_ids": torch.tensor([ctx + toks]),
        "position_ids": torch.tensor([list(range(C)) + pos]),
    }
    with torch.no_grad():
        implicit = model(**kwargs, use_cache=False)
    assert not torch.allclose(implicit.logits[0], phys, atol=1e-3)


def test_one_by_one_fills_one_slot_per_step(ckpts: dict[str, Path]) -> None:
    ckpt = ckpts["wedlm_qwen2"]
    out = reference_generate(ckpt, _prompt(ckpt), threshold=None, window=8, max_tokens=20)
    assert len(out["tokens"]) == 20
    assert set(out["fills"]) == {1} and len(out["fills"]) == out["forwards"]
    assert out["forwards"] >= len(out["tokens"])  # a fill commits one forward later at the earliest


def test_high_threshold_fills_several(ckpts: dict[str, Path]) -> None:
    ckpt = ckpts["wedlm_qwen3"]
    many = reference_generate(ckpt, _prompt(ckpt), threshold=10.0, window=8, max_tokens=24)
    assert max(many["fills"]) == 8 and many["forwards"] == 3  # fill all, then commit 8 per step
    mid = reference_generate(ckpt, _prompt(ckpt, "Once upon a time"), threshold=2.0, max_tokens=32)
    assert max(mid["fills"]) > 1 and min(mid["fills"]) == 1  # thresholds select, not all or nothing


def test_stop_token_ends_and_is_included(ckpts: dict[str, Path]) -> None:
    ckpt = ckpts["wedlm_qwen3"]
    free = reference_generate(ckpt, _prompt(ckpt), threshold=2.0, max_tokens=24)["tokens"]
    stop = free[5]
    cut = reference_generate(ckpt, _prompt(ckpt), threshold=2.0, max_tokens=24, stop_ids=(stop,))[
        "tokens"
    ]
    assert cut == free[: free.index(stop) + 1]


def test_ar_matches_generate(ckpts: dict[str, Path]) -> None:
    for fam in ("qwen3", "llama"):
        ckpt = ckpts[fam]
        prompt, eos = _prompt(ckpt), _config(ckpt)["eos_token_id"]
        ours = reference_generate(ckpt, prompt, mode="ar", max_tokens=16, stop_ids=(eos,))
        model = load_model(ckpt)
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=16,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        assert ours["tokens"] == gen[0, len(prompt) :].tolist()
        assert ours["forwards"] == len(ours["tokens"]) - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_families_load_and_run(ckpts: dict[str, Path], family: str) -> None:
    ckpt, cfg = ckpts[family], _config(ckpts[family])
    assert cfg["mask_token_id"] == AutoTokenizer.from_pretrained(ckpt).convert_tokens_to_ids(
        "<mask>"
    )
    out = reference_generate(ckpt, _prompt(ckpt), threshold=0.4, window=8, max_tokens=8)
    assert len(out["tokens"]) == 8 and all(0 <= t < cfg["vocab_size"] for t in out["tokens"])
    assert len(reference_generate(ckpt, _prompt(ckpt), mode="ar", max_tokens=4)["tokens"]) == 4


def test_wedlm_configs_load_like_their_base(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Same seed, same weights: the wedlm loader must reproduce the base family's logits."""
    ids = _prompt(ckpts["qwen3"])
    pos = list(range(len(ids)))
    for wedlm, base in (("wedlm_qwen3", "qwen3"), ("wedlm_qwen2", "qwen2")):
        assert _config(ckpts[wedlm])["model_type"] == "wedlm"
        a = _forward(load_model(ckpts[wedlm]), ids, pos)
        assert torch.allclose(a, _forward(load_model(ckpts[base]), ids, pos), atol=1e-5)
    sharded = make_checkpoint(tmp_path / "sharded", "wedlm_qwen3", shards=2)
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    b = _forward(load_model(sharded), ids, pos)
    assert torch.allclose(b, _forward(load_model(ckpts["wedlm_qwen3"]), ids, pos), atol=1e-6)
