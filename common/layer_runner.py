"""Runs one process's layer range over a batch of rows, keeping each sequence's KV.
Used in-process by the single-machine engine and behind gRPC by every worker."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from common.errors import WedlmError
from common.kv_format import FULL, KVFormat
from common.kv_rows import KVRows
from common.kv_store import KVStore
from common.layer_sizes import parts_dtype
from common.model_parts import ModelParts, run_layers
from common.rows_spec import RowsSpec


class RowsError(WedlmError):
    """A forward request that does not fit this process's state; `code` names the gRPC status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


MAX_WIDTH = 4096  # rows per sequence in one forward (window masks are B x T x T on the host)
# MLX keeps freed buffers for reuse; like mlx-lm (after each prompt chunk, every 256 decode
# steps) the cache is emptied after this many KV rows were written, or this many forwards, so
# that prompt-sized temporaries do not pile up beside the weights and the KV.
CLEAR_CACHE_ROWS = 2048
CLEAR_CACHE_FORWARDS = 256


def select_slots(hidden: mx.array, slots: np.ndarray) -> mx.array:
    """hidden [B, T, H] → [B, S, H]: slot slots[b, i] of row b. With S = 0 nothing is kept
    (evaluating the result still runs the layers: the KV they write is needed)."""
    return mx.take_along_axis(hidden, mx.array(slots, dtype=mx.int32)[:, :, None], axis=1)


def _check_quantized_kv(parts: ModelParts, kv: KVFormat) -> None:
    """Run the first layer once on two positions with this quantized KV: a family whose
    attention cannot read quantized KV (gpt-oss's attention sinks, in mlx-lm's quantized
    attention) is refused at the start, in one line, not at its first request."""
    caches = getattr(parts, "caches", ())
    first = next((i for i, c in enumerate(caches) if c.cached and not c.recurrent), 0)
    probe = SimpleNamespace(  # its first attention layer: recurrent state is never quantized
        layers=parts.layers[first : first + 1],
        caches=caches[first : first + 1],
        array_mask=getattr(parts, "array_mask", False),
    )
    dtype = parts_dtype(parts)
    hidden = mx.zeros((1, 2, parts.config.hidden_size), dtype)
    try:
        mx.eval(run_layers(probe, hidden, KVRows(1, 1, kv=kv), np.tri(2, dtype=bool)[None]))
    except Exception as e:  # mlx-lm's own refusal, whatever it raises
        raise WedlmError(
            f"{parts.config.family} cannot keep its KV quantized ({kv.label()}): {e}"
        ) from None


class LayerRunner:
    def __init__(self, parts: ModelParts, kv: KVFormat = FULL) -> None:
        """`kv`: how this process stores its KV (quantized or in the model's dtype)."""
        kv.check(parts.config)
        if kv.quantized and parts.layers and not parts.config.diffusion:
            _check_quantized_kv(parts, kv)
        self.parts = parts
        self.kv = kv
        states = tuple(c.state for c in getattr(parts, "caches", ()))
        self.store = KVStore(len(parts.layers), kv, states)
        self.max_positions = parts.config.max_position_embeddings
        self._rows_run = self._forwards_run = 0  # since MLX's buffer cache was last emptied

    def check(self, spec: RowsSpec, hidden_shape: tuple[int, ...]) -> None:
        b, t = spec.num_rows, spec.width
        hidden = self.parts.config.hidden_size
        if t > MAX_WIDTH:
            raise RowsError("INVALID_ARGUMENT", f"{t} rows per sequence exceed {MAX_WIDTH}")
        if tuple(hidden_shape) != (b, t, hidden):
            raise RowsError(
                "INVALID_ARGUMENT",
                f"hidden states have shape {tuple(hidden_shape)}, expected ({b}, {t}, {hidden})",
            )
        if len(set(spec.seq_ids)) != b:
            raise RowsError("INVALID_ARGUMENT", "a sequence appears twice in one forward")
        for arr, name in ((spec.starts, "starts"), (spec.widths, "widths"), (spec.keeps, "keeps")):
            if arr.shape != (b,):
                raise RowsError("INVALID_ARGUMENT", f"{name} must have one entry per row")
        if ((spec.widths < 1) | (spec.widths > t)).any():
            raise RowsError("INVALID_ARGUMENT", f"row widths must be in [1, {t}]")
        if ((spec.keeps < 0) | (spec.keeps > spec.widths)).any():
            raise RowsError("INVALID_ARGUMENT", "keep counts must be in [0, width]")
        if any(self.store.states) and ((spec.keeps > 0) & (spec.keeps < spec.widths)).any():
            raise RowsError(
                "INVALID_ARGUMENT",
                "these layers keep recurrent state, which cannot take back rows: a row "
                "keeps all of its width or none (padding)",
            )
        if spec.has_canvas:
            if not self.parts.config.diffusion:
                raise RowsError(
                    "INVALID_ARGUMENT",
                    f"canvas slots are for diffusion models; {self.parts.config.model_type} "
                    "decodes windows",
                )
            if (spec.keeps > spec.encoded()).any():
                raise RowsError("INVALID_ARGUMENT", "a canvas never becomes permanent KV")
            longest = int(max(spec.canvas.max(), 0 if spec.extent is None else spec.extent.max()))
            if longest > self.parts.config.canvas_length:
                raise RowsError(
                    "INVALID_ARGUMENT",
                    f"a canvas of {longest} slots exceeds this model's canvas_length "
                    f"{self.parts.config.canvas_length}",
                )
        if (spec.starts < 0).any() or (spec.starts + spec.reach() > self.max_positions).any():
            raise RowsError(
                "OUT_OF_RANGE", f"positions must stay within the context of {self.max_positions}"
            )
        forked = self._check_forks(spec)
        for sid, start in zip(spec.seq_ids, spec.starts, strict=True):
            if sid in forked:
                if forked[sid] != start:
                    raise RowsError(
                        "INVALID_ARGUMENT",
                        f"sequence {sid} forks {forked[sid]} rows but its window starts at "
                        f"{int(start)}",
                    )
                continue
            have = self.store.length(sid)
            if sid not in self.store and start != 0:
                raise RowsError("NOT_FOUND", f"unknown sequence {sid} (its KV is not here)")
            if have != start:
                raise RowsError(
                    "FAILED_PRECONDITION",
                    f"sequence {sid} has {have} KV rows here, the request says {int(start)}",
                )

    def _check_forks(self, spec: RowsSpec) -> dict[int, int]:
        """The forks' new sequences and their lengths, once each is known to be possible."""
        forked: dict[int, int] = {}
        rows = set(spec.seq_ids)
        for sid, source, length in spec.forks:
            if sid not in rows:
                raise RowsError("INVALID_ARGUMENT", f"fork into {sid}, which is not a row")
            if sid in forked or source in rows:
                raise RowsError(
                    "INVALID_ARGUMENT", f"fork {source} -> {sid}: each row forks once, "
                    "from a sequence that is not in the forward",
                )  # fmt: skip
            problem = self.store.fork_problem(sid, source, length)
            if problem is not None:
                code = "NOT_FOUND" if source not in self.store else "FAILED_PRECONDITION"
                raise RowsError(code, problem)
            forked[sid] = length
        return forked

    def forward(
        self,
        spec: RowsSpec,
        hidden: mx.array,
        validate: bool = True,
        reply_slots: np.ndarray | None = None,
    ) -> mx.array:
        """`validate=False` only for specs this process built itself (the in-process
        pipeline): a worker checks every request it receives. With `reply_slots` only
        those slots of the output are returned (select_slots)."""
        if validate:
            self.check(spec, hidden.shape)
        for sid, source, length in spec.forks:
            self.store.fork(sid, source, length)
        kv = self.store.rows_for(spec.seq_ids)
        if self.parts.config.diffusion:
            from common.diffusion.layers import run_diffusion_layers

            out = run_diffusion_layers(self.parts, hidden, kv, spec)
        else:
            out = run_layers(self.parts, hidden, kv, spec.windows(), spec.widths)
        kv.commit(spec.keeps)
        self._rows_run += int(spec.keeps.sum())  # KV rows written: what grows the buffers
        self._forwards_run += 1
        if self._rows_run >= CLEAR_CACHE_ROWS or self._forwards_run >= CLEAR_CACHE_FORWARDS:
            # Freed only at a point where nothing runs: MLX's CUDA backend records kernels
            # into graphs, and freeing device memory while one is being recorded aborts
            # the process (seen on an H100). One wait per 256 forwards.
            mx.synchronize()
            mx.clear_cache()
            self._rows_run = self._forwards_run = 0
        return select_slots(out, reply_slots) if reply_slots is not None else out

    def release(self, seq_ids: list[int]) -> None:
        self.store.release(seq_ids)

    def kv_bytes(self) -> int:
        return sum(b.nbytes() for b in self.store.batches)
