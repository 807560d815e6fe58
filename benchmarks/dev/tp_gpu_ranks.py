"""What each rank of benchmarks/dev/tp_gpu.py runs: mlx-lm's model loaded whole (one process,
one GPU) or as its TP shard (`sharded_load`, i.e. `Model.shard`, over the group mlx.launch
formed), then mlx-lm's own loops timed. Every rank runs the same calls on the same seeded
prompts (greedy, so the ranks stay in step); rank 0 writes the result file.

- bench: single-stream decode (`generate_step`, mlx-lm's loop with its async eval: tok/s
  from the first token to the last), C-stream aggregate decode (`BatchGenerator`, the
  median step while all C decode, its first SKIP steps left out) and
  prefill (`generate_step`'s time to its first token for a prompt of P tokens, its own
  2048-token chunks).
- profile: one decode step at a fixed context, synchronously (build the lazy graph, then
  eval it and wait), with the all_sum of every `ShardedToAllLinear` (o_proj, down_proj:
  2 per layer) as mlx-lm has it and with it replaced by the identity (the same matmuls, no
  collective: the numbers the ranks then compute are wrong and they drift apart, the time
  is each rank's compute alone); and the all_sums alone, one at a time and chained as a
  forward issues them, on this group's backend."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.dev.bench_io import build_then_wait, median_ms, now

SKIP = 4  # first decode steps of a BatchGenerator run are not measured (new shapes)


def rank_main(task: str, p: dict[str, Any]) -> None:
    if p["tp"] > 1:
        group = mx.distributed.init(backend=p["backend"], strict=True)
    else:
        group = mx.distributed.init()  # alone: a group of one
    t0 = now()
    model = load(Path(p["model"]), group)
    result: dict[str, Any] = {"tp": group.size(), "load_s": round(now() - t0, 2)}
    result.update({"bench": bench, "profile": profile}[task](model, group, p))
    if group.rank() == 0:
        Path(p["result"]).write_text(json.dumps(result))


def load(path: Path, group):
    """mlx-lm's model, split with its own `Model.shard` when the group has several ranks.
    Not `sharded_load`: in mlx-lm 0.32.2 it runs an all_sum on the CPU stream first, which
    MLX's NCCL backend refuses ("There is no Stream(gpu, 1) in current thread")."""
    from mlx_lm.utils import load as load_whole

    model, _ = load_whole(str(path), lazy=group.size() > 1)
    if group.size() > 1:
        model.shard(group)
        mx.eval(model.parameters())
    return model


def prompt(length: int, vocab: int, seed: int) -> mx.array:
    """The same ids on every rank (numpy, seeded), clear of the special ids at the top."""
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(10, min(vocab, 150000), length).astype(np.int32))


def _barrier(group) -> None:
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))


# ---- bench ---------------------------------------------------------------------------------
def bench(model, group, p: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    vocab = model.args.vocab_size
    if "decode" in p["what"]:
        _barrier(group)
        out["decode"] = decode(model, prompt(p["prompt"], vocab, 1), p["tokens"], p["repeats"])
    if "batch" in p["what"]:
        _barrier(group)
        out["batch"] = batch(model, p["concurrency"], p["tokens"], p["repeats"], vocab)
    if "prefill" in p["what"]:
        _barrier(group)
        out["prefill"] = prefill(model, prompt(p["prefill"], vocab, 2), p["repeats"])
    return out


def decode(model, ids: mx.array, tokens: int, repeats: int) -> dict[str, Any]:
    """tok/s of one stream: (tokens - 1) / the time from its first token to its last."""
    from mlx_lm.generate import generate_step

    runs = []
    for r in range(repeats + 1):  # the first warms up (new shapes)
        times = [now() for _ in generate_step(ids, model, max_tokens=tokens)]
        mx.synchronize()
        if r:
            runs.append((tokens - 1) / (times[-1] - times[0]))
    return {"prompt": len(ids), "tokens": tokens, "tok_s": round(statistics.median(runs), 2),
            "runs_tok_s": [round(x, 2) for x in runs]}  # fmt: skip


def batch(model, c: int, tokens: int, repeats: int, vocab: int) -> dict[str, Any]:
    """C streams in mlx-lm's BatchGenerator: aggregate tok/s = C / the median step."""
    if tokens < SKIP + 3:
        raise ValueError(f"batch needs --tokens >= {SKIP + 3} (its first {SKIP} steps are skipped)")
    prompts = prompts_for(c, vocab)
    runs = []
    for r in range(repeats + 1):
        ms = batch_step_ms(model, prompts, tokens)
        if r:
            runs.append(c * 1e3 / ms)
    return {"concurrency": c, "tokens": tokens, "tok_s": round(statistics.median(runs), 2),
            "runs_tok_s": [round(x, 2) for x in runs]}  # fmt: skip


def prompts_for(batch: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """`batch` seeded prompts of different lengths (every row its own KV length)."""
    rng = np.random.default_rng(seed)
    high = min(vocab, 5000)
    return [[int(t) for t in rng.integers(high // 10, high, 24 + 5 * i)] for i in range(batch)]


def batch_step_ms(model, prompts: list[list[int]], n: int) -> float:
    """The median BatchGenerator step (ms) while every row decodes, past the first SKIP."""
    from mlx_lm.generate import BatchGenerator

    b = len(prompts)
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=[], completion_batch_size=b,
                         prefill_batch_size=b)  # fmt: skip
    gen.insert(prompts)
    steps, started = [], False
    while True:
        start = now()
        responses = gen.next_generated()
        dt = now() - start
        if not responses:
            break
        if started and len(responses) == b and all(r.finish_reason is None for r in responses):
            steps.append(dt)
        started = started or len(responses) == b
        if all(r.finish_reason is not None for r in responses):
            break
    gen.close()
    return 1e3 * statistics.median(steps[SKIP:])


def prefill(model, ids: mx.array, repeats: int) -> dict[str, Any]:
    """generate_step's time to its first token for the whole prompt, in its own chunks."""
    from mlx_lm.generate import generate_step

    runs = []
    for r in range(repeats + 1):
        t0 = now()
        gen = generate_step(ids, model, max_tokens=1)
        next(gen)
        dt = now() - t0
        gen.close()
        mx.synchronize()  # the step it queued after the first token
        if r:
            runs.append(dt)
    ms = statistics.median(runs) * 1e3
    return {"prompt": len(ids), "ms": round(ms, 2), "tok_s": round(len(ids) / ms * 1e3, 1),
            "runs_ms": [round(x * 1e3, 2) for x in runs]}  # fmt: skip


# ---- profile -------------------------------------------------------------------------------
@contextmanager
def no_all_sum() -> Iterator[None]:
    """ShardedToAllLinear without its all_sum (the same matmul and bias) inside the block;
    mlx's own again on exit."""
    from mlx.nn.layers.distributed import ShardedToAllLinear

    original = ShardedToAllLinear.__call__

    def local(self, x: mx.array) -> mx.array:
        x = x @ self["weight"].T
        return x + self["bias"] if "bias" in self else x

    ShardedToAllLinear.__call__ = local
    try:
        yield
    finally:
        ShardedToAllLinear.__call__ = original


def all_sums_per_forward(model) -> int:
    from mlx.nn.layers.distributed import ShardedToAllLinear

    return sum(isinstance(m, ShardedToAllLinear) for _, m in model.named_modules())


def step_profile(model, context: int, steps: int, vocab: int) -> dict[str, Any]:
    """Medians over `steps` one-token forwards after a prompt of `context` tokens: the
    Python that builds the lazy graph, then eval and wait (MLX's encoding, the kernels, the
    collectives); the last few steps once more through the layers without the head."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    last = [mx.argmax(model(prompt(context, vocab, 3)[None], cache=cache)[:, -1], axis=-1)]
    mx.eval(last[0])

    def step() -> mx.array:
        last[0] = mx.argmax(model(last[0][None], cache=cache)[:, -1], axis=-1)
        return last[0]

    build, wait = build_then_wait(step, steps)
    y = last[0]
    layers = []
    for _ in range(max(3, steps // 2)):
        t0 = now()
        mx.eval(model.model(y[None], cache=cache))
        layers.append(now() - t0)
    b, w = statistics.median(build) * 1e3, statistics.median(wait) * 1e3
    return {"build_ms": round(b, 3), "eval_ms": round(w, 3), "step_ms": round(b + w, 3),
            "layers_only_ms": round(statistics.median(layers) * 1e3, 3)}  # fmt: skip


def all_sums_alone(group, hidden: int, chain: int, repeats: int) -> dict[str, Any]:
    """Median ms of one all_sum of a bf16 hidden state (an eval each), and per all_sum when
    `chain` of them run in one graph (the way a forward issues them: 2 per layer)."""
    x = mx.ones((1, 1, hidden), mx.bfloat16)
    mx.eval(x)
    _barrier(group)
    one = median_ms(lambda: mx.eval(mx.distributed.all_sum(x, group=group)), repeats, warmup=5)

    def chained() -> None:
        y = x
        for _ in range(chain):  # the scale keeps values finite; it is one tiny op
            y = mx.distributed.all_sum(y, group=group) * 0.5
        mx.eval(y)

    _barrier(group)
    in_chain = median_ms(chained, max(3, repeats // 10), warmup=1) / chain
    n = int(x.nbytes)
    return {"message": f"hidden {hidden} bfloat16", "bytes": n, "ms_one": round(one, 4),
            "ms_in_chain": round(in_chain, 4), "MB_s_one": round(n / one / 1e3, 1)}  # fmt: skip


def profile(model, group, p: dict[str, Any]) -> dict[str, Any]:
    vocab = model.args.vocab_size
    out: dict[str, Any] = {"context": p["context"], "steps": p["steps"]}
    _barrier(group)
    out["with_all_sum"] = step_profile(model, p["context"], p["steps"], vocab)
    if group.size() == 1:
        return out
    out["all_sums_per_forward"] = n = all_sums_per_forward(model)
    _barrier(group)
    with no_all_sum():
        out["without_all_sum"] = step_profile(model, p["context"], p["steps"], vocab)
    _barrier(group)
    row = all_sums_alone(group, model.args.hidden_size, n, p["collective_repeats"])
    per_step = round(row["ms_in_chain"] * n, 3)
    out["all_sum_alone"] = {**row, "chain": n, "ms_per_step_in_chain": per_step}
    return out
