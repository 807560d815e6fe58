"""The small-query attention kernel (issue 35): which attentions it takes, that the model's
attention is routed through it without changing anything it does not take, and (on CUDA,
where it runs) that it equals MLX's own attention."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx_lm.models.llama as llama
import numpy as np
import pytest

from common import small_query_attention as sqa
from common.kv_rows import KVRows
from common.model_parts import load_model_parts, run_layers
from common.window_mask import attention_mask, batch_window_masks, window_visibility


def _qkv(b: int, t: int, span: int, dim: int = 64, dtype=mx.float16):
    heads, kv_heads = 9, 3  # SmolLM2-135M's
    rng = np.random.default_rng(b * 100 + t)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q = normal(b, t, heads, dim).transpose(0, 2, 1, 3)  # the layout mlx-lm's attention has
    k = normal(b + 1, kv_heads, span + 64, dim)[:b, :, :span, :]  # a slice, as KVRows returns
    v = normal(b + 1, kv_heads, span + 64, dim)[:b, :, :span, :]
    windows = batch_window_masks([rng.random(t) < 0.5 for _ in range(b)], t)
    starts = mx.array(rng.integers(0, span - t + 1, size=b), dtype=mx.int32)
    return q, k, v, attention_mask(starts, mx.array(windows), span)


def test_it_takes_up_to_32_masked_query_rows_and_causal_ones_from_two():
    q, k, v, mask = _qkv(2, 8, 128)
    assert sqa.fits(q, k, v, mask) and sqa.fits(q, k, v, "causal")
    one, _, _, one_mask = _qkv(2, 1, 128)
    assert sqa.fits(one, k, v, one_mask)  # AR rows of different lengths: MLX has no kernel
    assert not sqa.fits(one, k, v, None)  # one row, no mask: MLX's vector kernel
    assert not sqa.fits(q, k, v, mask[:1])  # a mask broadcast over the rows
    wide, wk, wv, wide_mask = _qkv(1, 33, 128)
    assert not sqa.fits(wide, wk, wv, wide_mask)  # a prefill chunk: cuDNN
    assert not sqa.fits(q, k, v, mask.astype(mx.float16))  # an additive mask
    assert not sqa.fits(q, k, v, None)
    odd, ok, ov, odd_mask = _qkv(1, 4, 64, dim=96)
    assert not sqa.fits(odd, ok, ov, odd_mask)  # a head dim it does not unroll
    long_q, lk, lv, long_mask = _qkv(1, 4, sqa.MAX_KEYS + 64)
    assert not sqa.fits(long_q, lk, lv, long_mask)  # scores past shared memory
    assert not sqa.fits(q, k.astype(mx.bfloat16), v, mask)


def test_it_is_off_where_mlx_does_not_run_on_cuda(monkeypatch):
    monkeypatch.delenv("WEDLM_SMALL_QUERY_ATTENTION", raising=False)
    assert sqa.enabled() == sqa.available()
    monkeypatch.setenv("WEDLM_SMALL_QUERY_ATTENTION", "0")
    assert not sqa.enabled()
    monkeypatch.setenv("WEDLM_SMALL_QUERY_ATTENTION", "wide")  # one row left to MLX
    assert not sqa.enabled(1) and sqa.enabled(2) == sqa.available()


def test_a_model_family_is_routed_once_and_what_the_kernel_does_not_take_is_unchanged(
    checkpoint_dir, monkeypatch
):
    # head_dim 64: attentions the kernel takes
    parts = load_model_parts(checkpoint_dir("llama", num_hidden_layers=2, head_dim=64))
    routed = llama.scaled_dot_product_attention
    assert routed.wraps is not None
    sqa.install(llama)
    assert llama.scaled_dot_product_attention is routed  # not wrapped twice

    def forward() -> np.ndarray:
        kv = KVRows(len(parts.layers), 1)
        ids = mx.array(np.arange(12, dtype=np.int32)[None] % parts.config.vocab_size)
        mx.eval(run_layers(parts, parts.embed(ids), kv, np.tri(12, dtype=bool)[None]))
        kv.commit([12])
        filled = np.array([True, False, True, False, False, True, False, False])
        window = window_visibility(filled)[None]
        ids = mx.array(np.arange(8, dtype=np.int32)[None] + 3)
        return np.array(run_layers(parts, parts.embed(ids), kv, window).astype(mx.float32))

    taken = []
    fits = sqa.fits
    monkeypatch.setattr(sqa, "fits", lambda *a: taken.append(fits(*a)) or taken[-1])
    monkeypatch.setenv("WEDLM_SMALL_QUERY_ATTENTION", "0")
    cuda = sqa.available()
    monkeypatch.setattr(sqa, "available", lambda: True)  # asks fits on the CPU too
    unrouted = forward()
    # each layer's attention fits: the 12-row causal prompt and the 8-row window
    assert taken == [True] * 4
    monkeypatch.setattr(sqa, "available", lambda: cuda)
    monkeypatch.delenv("WEDLM_SMALL_QUERY_ATTENTION")
    through = forward()
    if sqa.available():  # the kernel ran: equal within half precision's rounding
        np.testing.assert_allclose(through, unrouted, atol=2e-2)
    else:  # passed straight to mlx-lm's attention
        np.testing.assert_array_equal(through, unrouted)


@pytest.mark.skipif(not sqa.available(), reason="the kernel runs on MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "b,t,span", [(1, 2, 64), (1, 16, 128), (8, 8, 192), (4, 32, 512), (3, 5, 64), (8, 1, 320)]
)
def test_it_equals_mlx_attention_on_cuda(dtype, b, t, span):
    q, k, v, mask = _qkv(b, t, span, dtype=dtype)
    for m in (mask, "causal") if t > 1 else (mask,):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
        got = sqa.small_query_attention(q, k, v, 0.125, m)
        assert got.shape == want.shape
        np.testing.assert_allclose(
            np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=1e-2
        )


def test_the_kernel_source_sent_to_mlx_is_the_source_without_comments_or_indentation():
    """MLX rebuilds and hashes the source on every call: it goes without comments, but
    every token, and each preprocessor line on its own line, stays."""
    for setup, seen in (sqa._MASKED, sqa._CAUSAL):
        source = sqa._SOURCE.replace("{SEEN_SETUP}", setup).replace("{SEEN}", seen)
        compact = sqa._compact(source)
        assert "//" not in compact and len(compact) < 0.8 * len(source)
        assert compact.split() == re.sub(r"//[^\n]*", "", source).split()
        assert all(line.startswith("#pragma") for line in compact.splitlines() if "#" in line)
