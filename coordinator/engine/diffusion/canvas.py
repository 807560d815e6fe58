"""One request's canvas: the positions being denoised, which of them are revealed, the
random number stream the reference sampler draws from, and the self-conditioning signal
the next forward reads. The request's state machine, one forward per step:

    prefill (prompt chunks; the last one carries the first canvas)
      -> denoise steps (the canvas alone)
      -> [turbo: a repair forward]
      -> commit the canvas: its tokens are the request's output; the next forward encodes
         them (causal, KV kept) in the same row as the next canvas's first step
      -> ... until a stop token, max_tokens or a guard ends the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Sequence


@dataclass
class Canvas:
    length: int
    tokens: np.ndarray  # [L] the next forward's input: revealed tokens, random elsewhere
    draft: np.ndarray  # [L] revealed tokens (where revealed)
    revealed: np.ndarray  # [L] bool
    steps: int  # denoising steps this canvas may take (the reference's N)
    key: mx.array  # the request's random stream (mx.random's key sequence, per request)
    taken: int = 0  # steps run so far
    conditioning: mx.array | None = None  # [L, H] soft embeddings from the last step
    history: list[np.ndarray] = field(default_factory=list)  # argmax canvases (stability)
    repairing: bool = False  # turbo: the next forward re-reads the drained canvas
    live: np.ndarray | None = None  # turbo: positions the next forward must compute

    def restart(self) -> None:
        """The stages lost this canvas's K/V (a worker was lost): its next forward is whole
        (nothing of it can be reused), then it goes on from the same state and stream."""
        self.live = None

    @property
    def step(self) -> int:
        """The reference's cur_step: N for the first forward, counting down to 1."""
        return self.steps - self.taken


def next_key(key: mx.array) -> tuple[mx.array, mx.array]:
    """(the stream's next state, a key for one draw): exactly what mx.random's global key
    sequence does, so a request seeded with s draws what `mx.random.seed(s)` would."""
    pair = mx.random.split(key, stream=mx.cpu)
    return pair[0], pair[1]


def random_tokens(canvas: Canvas, vocab: int) -> mx.array:
    """[L] uniform random tokens from the canvas's stream (the reference's fill for
    unrevealed positions), drawn on the CPU: small, and never waits on the GPU's queue."""
    canvas.key, draw = next_key(canvas.key)
    return mx.random.randint(0, vocab, (1, canvas.length), key=draw, stream=mx.cpu)[0]


def new_canvas(length: int, steps: int, vocab: int, key: mx.array) -> Canvas:
    canvas = Canvas(
        length=length,
        tokens=np.zeros(length, np.int32),
        draft=np.zeros(length, np.int32),
        revealed=np.zeros(length, bool),
        steps=steps,
        key=key,
    )
    first = random_tokens(canvas, vocab)
    mx.eval(first, canvas.key)  # CPU work only
    canvas.tokens = np.array(first, dtype=np.int32)
    canvas.draft = canvas.tokens.copy()
    return canvas


def pending(seq: Sequence) -> list[int]:
    """Committed tokens whose KV is not stored yet (the last committed canvas)."""
    return (seq.prompt + seq.output)[seq.kv_length :]


def bucket(n: int, buckets: tuple[int, ...], limit: int) -> int:
    """The forwarded slot count for n live positions: the next bucket, at most `limit`."""
    return min(next((b for b in buckets if b >= n), limit), limit)


def plan_compacted(seq: Sequence, buckets: tuple[int, ...]) -> RowPlan | None:
    """The canvas's live positions only (turbo's active set: the unrevealed ones and
    those revealed by the last step, whose K/V must see their new token), padded with
    duplicates to a bucket; None when that would be the whole canvas."""
    canvas = seq.canvas
    live = np.flatnonzero(canvas.live)
    n = bucket(live.size, buckets, canvas.length)
    if live.size == 0 or n >= canvas.length:
        return None
    slots = np.concatenate([live, np.full(n - live.size, live[0])]).astype(np.int64)
    return RowPlan(
        seq=seq,
        tokens=canvas.tokens[slots].astype(np.int32),
        filled=np.ones(n, dtype=bool),
        keep=0,
        head_slots=np.arange(n),
        head_is_mask=np.ones(n, dtype=bool),
        canvas=n,
        offsets=slots,
        extent=canvas.length,
    )


def forwarded(plan: RowPlan) -> np.ndarray:
    """The canvas positions a plan's canvas slots compute, in slot order."""
    if plan.offsets is not None:
        return plan.offsets
    return np.arange(plan.seq.canvas.length)


def plan_canvas(seq: Sequence, encode: list[int] | np.ndarray) -> RowPlan:
    """A row of `encode` tokens (causal, kept) followed by the canvas; logits are read
    for every canvas slot."""
    canvas = seq.canvas
    encode = np.asarray(encode, dtype=np.int32)
    e = encode.size
    tokens = np.concatenate([encode, canvas.tokens]).astype(np.int32)
    return RowPlan(
        seq=seq,
        tokens=tokens,
        filled=np.ones(tokens.size, dtype=bool),
        keep=e,
        head_slots=np.arange(e, e + canvas.length),
        head_is_mask=np.ones(canvas.length, dtype=bool),
        canvas=canvas.length,
    )
