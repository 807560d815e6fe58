"""Diffusion decoding (DiffusionGemma) on tiny random checkpoints made by mlx-vlm's own
model classes: faithful mode equals mlx-vlm's reference sampler token for token (in one
process, batched, and through two workers holding layer ranges), the turbo techniques do
what they claim, and bad input gets a clear error."""

from __future__ import annotations

import sys
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import CheckpointError, InvalidRequest
from common.generation_params import GenerationParams
from common.layer_runner import LayerRunner, RowsError
from common.model_parts import load_model_parts
from common.rows_spec import RowsSpec
from coordinator.engine.diffusion.engine import DiffusionEngine
from coordinator.engine.diffusion.scheduler import repeat_end
from coordinator.engine.diffusion.settings import load_settings
from coordinator.engine.diffusion.topk import hierarchical_topk
from coordinator.engine.engine import Engine
from coordinator.engine.forward_shapes import ShapeLimits
from coordinator.engine.pipeline import LocalPipeline
from tests.support.diffusion_checkpoints import make_diffusion_checkpoint
from tests.support.reference_diffusion import reference_tokens

PROMPTS = [[5, 9, 17, 33, 2], list(range(40, 60)), [300, 12, 7, 7, 90, 4, 61, 18, 250, 3, 11]]


@pytest.fixture(scope="module")
def dg(tmp_path_factory):
    return make_diffusion_checkpoint(tmp_path_factory.mktemp("dg") / "f32", seed=1)


@pytest.fixture(scope="module")
def dg4(tmp_path_factory):
    return make_diffusion_checkpoint(tmp_path_factory.mktemp("dg") / "q4", seed=2, bits=4)


def engine_of(path, rows: int = 8, **turbo) -> DiffusionEngine:
    """An in-process engine; `turbo` overrides the turbo sampler's settings (the tiny
    canvas of 16 needs buckets below 16 for compaction to happen)."""
    parts = load_model_parts(path)
    settings = load_settings(parts.config)
    settings = replace(settings, turbo=replace(settings.turbo, **turbo))
    return DiffusionEngine(parts, LocalPipeline(parts), rows, settings=settings)


SMALL_BUCKETS = {"buckets": (1 / 8, 1 / 4, 1 / 2, 3 / 4)}


def run(engine, jobs: list[tuple[list[int], GenerationParams]]):
    seqs = [engine.submit(p, params) for p, params in jobs]
    while engine.has_work:
        engine.step()
    return seqs


def faithful(seed: int, max_tokens: int = 40, **kw) -> GenerationParams:
    return GenerationParams(
        mode="diffusion", sampler="faithful", max_tokens=max_tokens, seed=seed, **kw
    )


# ---- faithful mode = mlx-vlm's reference sampler ----------------------------------------
@pytest.mark.parametrize("which", ["dg", "dg4"])
def test_faithful_batched_equals_reference(which, request):
    """Three requests in shared forwards (prompts longer than the sliding window, three
    canvases each, 4-bit experts in the quantized checkpoint) equal mlx-vlm's sampler."""
    path = request.getfixturevalue(which)
    seqs = run(engine_of(path), [(p, faithful(i)) for i, p in enumerate(PROMPTS)])
    for i, (prompt, seq) in enumerate(zip(PROMPTS, seqs, strict=True)):
        assert seq.output == reference_tokens(path, prompt, 40, seed=i)
        assert seq.canvases == 3 and seq.finish_reason == "length"


def test_faithful_steps_cap_and_short_last_canvas_equal_reference(dg):
    """A step budget smaller than the canvas (forced commits, the last step's argmax) and
    a max_tokens that is not a multiple of the canvas."""
    seqs = run(engine_of(dg), [(PROMPTS[1], faithful(7, max_tokens=21, steps=3))])
    assert seqs[0].output == reference_tokens(dg, PROMPTS[1], 21, seed=7, steps=3)
    assert len(seqs[0].output) == 21


def test_faithful_sampling_equals_reference(dg):
    """At temperature 1 the reference draws its proposals from mx.random's stream: a
    request seeded with s draws the same (its own stream, in the same order)."""
    params = faithful(9, max_tokens=24, temperature=1.0)
    seq = run(engine_of(dg), [(PROMPTS[2], params)])[0]
    assert seq.output == reference_tokens(dg, PROMPTS[2], 24, seed=9, temperature=1.0)


def test_outputs_do_not_depend_on_batch_mates(dg):
    """Greedy outputs alone equal outputs beside other requests (arriving one step apart,
    so rows join and leave batches), for both samplers, turbo with compaction."""
    for sampler in ("faithful", "turbo"):
        params = [
            GenerationParams(mode="diffusion", sampler=sampler, max_tokens=33 + 9 * i, seed=i)
            for i in range(3)
        ]
        engine = engine_of(dg, **SMALL_BUCKETS)
        together = []
        for prompt, p in zip(PROMPTS, params, strict=True):
            together.append(engine.submit(prompt, p))
            engine.step()
        while engine.has_work:
            engine.step()
        for prompt, p, seq in zip(PROMPTS, params, together, strict=True):
            alone = run(engine_of(dg, rows=1, **SMALL_BUCKETS), [(prompt, p)])[0]
            assert seq.output == alone.output, sampler
        if sampler == "turbo":
            assert engine.scheduler.compacted_rows > 0


def test_compacted_forward_of_every_position_is_the_plain_forward_bit_for_bit(dg4):
    """The compacted path (scattered K/V writes, per-slot RoPE, the canvas-extent mask)
    with the whole canvas forwarded equals the plain canvas forward exactly; forwarding a
    subset of an unchanged canvas then gives exactly the plain forward's values there
    (the positions left out are served from the K/V their last forward wrote)."""
    parts = load_model_parts(dg4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 300, 20), rng.integers(0, 300, 9)]
    canvases = np.stack([rng.integers(0, 300, 16) for _ in range(2)]).astype(np.int32)

    def prefilled() -> LayerRunner:
        runner = LayerRunner(parts)
        tokens = np.zeros((2, 20), np.int32)
        tokens[0], tokens[1, :9] = prompts
        filled = tokens > -1
        filled[1, 9:] = False
        spec = RowsSpec([0, 1], np.zeros(2, int), np.array([20, 9]), filled, np.array([20, 9]))
        mx.eval(runner.forward(spec, parts.embed(mx.array(tokens))))
        return runner

    def canvas_spec(offsets=None) -> RowsSpec:
        spec = RowsSpec(
            [0, 1], np.array([20, 9]), np.array([16, 16]), np.ones((2, 16), bool),
            np.zeros(2, int), canvas=np.array([16, 16]),
        )  # fmt: skip
        if offsets is not None:
            spec.offsets, spec.extent = offsets, np.array([16, 16])
        return spec

    hidden = parts.embed_canvas(mx.array(canvases), None)
    plain = prefilled().forward(canvas_spec(), hidden)
    compact = prefilled()
    everything = compact.forward(canvas_spec(np.tile(np.arange(16), (2, 1))), hidden)
    assert mx.array_equal(plain, everything).item()
    slots = np.array([[3, 7, 8, 3] + [3] * 12, list(range(16))])  # padded with duplicates
    subset = mx.array(np.take_along_axis(canvases, slots, axis=1))
    out = compact.forward(canvas_spec(slots), parts.embed_canvas(subset, None))
    assert mx.array_equal(out[0, :3], plain[0, mx.array([3, 7, 8])]).item()
    assert mx.array_equal(out[1], plain[1]).item()


def test_sampling_is_seeded_per_request(dg):
    """Temperature > 0 (both samplers): the same seed gives the same text, alone or
    batched; another seed another text."""
    for sampler in ("faithful", "turbo"):

        def params(seed: int, s: str = sampler) -> GenerationParams:
            return GenerationParams(
                mode="diffusion", sampler=s, temperature=1.0, max_tokens=24, seed=seed
            )

        alone = run(engine_of(dg), [(PROMPTS[0], params(5))])[0].output
        batched = run(engine_of(dg), [(PROMPTS[1], params(1)), (PROMPTS[0], params(5))])
        other = run(engine_of(dg), [(PROMPTS[0], params(6))])[0].output
        assert batched[1].output == alone != other, sampler


def test_auto_mode_is_diffusion_and_commits_share_forwards(dg):
    """Mode auto resolves to diffusion; a canvas's commit rides with the next canvas's
    first step (no forward of its own): forwards = denoising steps."""
    engine = engine_of(dg)
    seq = run(engine, [(PROMPTS[0], GenerationParams(mode="auto", max_tokens=40))])[0]
    assert seq.params.mode == "diffusion" and len(seq.output) == 40
    assert engine.forwards == engine.scheduler.steps_run


# ---- turbo techniques ------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(3, 3000),
    st.integers(1, 64),
    st.sampled_from([16, 64, 256]),
    st.integers(0, 2**31 - 1),
)
def test_hierarchical_topk_is_exact(rows, vocab, k, chunk, seed):
    logits = mx.random.normal((rows, vocab), key=mx.random.key(seed))
    vals, ids = hierarchical_topk(logits, k, chunk)
    k = min(k, vocab)
    full = np.sort(np.array(logits), axis=-1)[:, ::-1][:, :k]
    np.testing.assert_array_equal(np.array(vals), full)
    got = np.take_along_axis(np.array(logits), np.array(ids), axis=-1)
    np.testing.assert_array_equal(got, full)  # the indices point at those values
    assert all(len(set(r)) == k for r in np.array(ids).tolist())


def test_turbo_shapes_stay_bounded_over_a_long_mixed_run(dg):
    """Many requests of mixed lengths, samplers and arrival times: the distinct forward
    shapes stay within the engine's bound, and well under it."""
    engine = engine_of(dg, rows=8)
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(24):
        n = int(rng.integers(1, 70))
        prompt = [int(t) for t in rng.integers(0, 300, n)]
        sampler = ("turbo", "faithful")[i % 3 == 0]
        seqs.append(
            engine.submit(
                prompt,
                GenerationParams(
                    mode="diffusion", sampler=sampler, max_tokens=int(rng.integers(1, 50)), seed=i
                ),
            )
        )
        engine.step()
    while engine.has_work:
        engine.step()
    assert all(s.finished for s in seqs)
    assert engine.scheduler.compacted_rows > 0  # compacted canvases among them
    limits: ShapeLimits = engine.shape_limits()
    assert all(limits.admits(key) for key in engine.shapes.seen)
    assert engine.shapes.count <= 40 < limits.bound()


def test_turbo_eos_tail_drop_stops_at_a_confident_stop_token(dg):
    """With the model's most likely first token as a stop id, turbo ends the request at
    that token, as the stop rule does."""
    engine = engine_of(dg)
    probe = run(engine, [(PROMPTS[2], GenerationParams(mode="diffusion", max_tokens=16))])[0]
    stop = probe.output[3]
    params = GenerationParams(mode="diffusion", max_tokens=64, stop_ids=(stop,))
    seq = run(engine_of(dg), [(PROMPTS[2], params)])[0]
    assert seq.finish_reason == "stop" and seq.output[-1] == stop
    assert stop not in seq.output[:-1]


def test_experts_grouped_by_expert_equal_the_per_pair_gather(dg4, monkeypatch):
    """The batched expert gathers (pairs grouped by expert, one matmul per projection)
    give exactly mlx-vlm's per-pair outputs, 4-bit experts included; shapes stay few."""
    from common.diffusion.grouped_experts import capacity_bucket

    parts = load_model_parts(dg4)
    experts, router = parts.layers[0].experts, parts.layers[0].router
    x = mx.random.normal((96, 64), key=mx.random.key(3))
    idx, _ = router(x)
    monkeypatch.setenv("WEDLM_MOE_GROUPED", "0")
    per_pair = experts(x, idx)
    monkeypatch.setenv("WEDLM_MOE_GROUPED", "1")
    grouped = experts(x, idx)
    assert mx.array_equal(per_pair, grouped).item()
    sizes = {capacity_bucket(n) for n in range(1, 4097)}
    assert all(capacity_bucket(n) >= n for n in range(1, 4097)) and len(sizes) <= 24


def test_repeat_guard():
    assert repeat_end([1, 2] + [7] * 16 + [3, 3], 0, 16) == 18
    assert repeat_end([7] * 10 + [7] * 8, 10, 16) == 16  # a run across two canvases
    assert repeat_end([7] * 15 + [8], 0, 16) is None
    assert repeat_end([7] * 40, 0, 0) is None  # off


# ---- bad input ----------------------------------------------------------------------------
def test_wrong_modes_are_refused(dg, checkpoint_dir):
    engine = engine_of(dg)
    with pytest.raises(InvalidRequest, match="decodes by diffusion"):
        engine.submit([1, 2, 3], GenerationParams(mode="wedlm"))
    wedlm = load_model_parts(checkpoint_dir("wedlm_qwen3", seed=3))
    with pytest.raises(InvalidRequest, match="needs a block-diffusion model"):
        Engine(wedlm, LocalPipeline(wedlm), 1).submit([1, 2], GenerationParams(mode="diffusion"))
    with pytest.raises(InvalidRequest, match="sampler must be one of"):
        GenerationParams(mode="diffusion", sampler="fast")
    with pytest.raises(InvalidRequest, match="steps must be between"):
        GenerationParams(mode="diffusion", steps=-1)
    with pytest.raises(InvalidRequest, match="exceeds the model's context"):
        engine.submit([1] * 400, GenerationParams(mode="diffusion", max_tokens=200))


def test_canvas_longer_than_the_checkpoints_is_refused(dg):
    parts = load_model_parts(dg)
    runner = LayerRunner(parts)
    spec = RowsSpec([0], np.zeros(1), np.array([24]), np.ones((1, 24), bool), np.array([0]))
    spec.canvas = np.array([24])
    with pytest.raises(RowsError, match="exceeds this model's canvas_length 16"):
        runner.check(spec, (1, 24, 64))


def test_bad_canvas_length_in_config_is_refused(tmp_path):
    import json

    path = make_diffusion_checkpoint(tmp_path / "bad", seed=3)
    config = json.loads((path / "config.json").read_text())
    config["canvas_length"] = 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="canvas_length must be a positive integer"):
        load_model_parts(path)


def test_missing_mlx_vlm_names_the_extra(dg, monkeypatch):
    for name in [m for m in sys.modules if m == "mlx_vlm" or m.startswith("mlx_vlm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # import mlx_vlm now fails
    with pytest.raises(CheckpointError, match=r"wedlm-cluster\[diffusion\]"):
        load_model_parts(dg)
