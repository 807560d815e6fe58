"""Checks a ForwardRequest's shape before any MLX work and turns it into a RowsSpec.
Only what the message itself can get wrong is checked here; what depends on the KV this
worker holds (unknown sequences, committed lengths, the context) is LayerRunner's check."""

from __future__ import annotations

import numpy as np

from common.layer_runner import RowsError
from common.proto_gen import wedlm_pb2 as pb
from common.rows_spec import RowsSpec
from common.wire_frames import Framed, WireTensor

WIRE_DTYPES = {
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_FLOAT16: "float16",
    pb.DTYPE_BFLOAT16: "bfloat16",
}
MAX_MASK_ELEMENTS = 1 << 30  # B×T×T window visibilities built on the host


def _invalid(message: str) -> RowsError:
    return RowsError("INVALID_ARGUMENT", message)


def hidden_of(request: pb.ForwardRequest | Framed) -> WireTensor | pb.Tensor | None:
    """The request's hidden states: split off as received (Framed), or the message field."""
    if isinstance(request, Framed):
        return request.tensor
    return request.hidden if request.HasField("hidden") else None


def rows_spec(
    request: pb.ForwardRequest | Framed, hidden_size: int, max_positions: int
) -> RowsSpec:
    """The request's RowsSpec; raises RowsError naming the first problem found."""
    b = len(request.seq_ids)
    if b == 0:
        raise _invalid("a forward needs at least one row (seq_ids is empty)")
    for name in ("committed", "widths", "keep", "positions"):
        n = len(getattr(request, name))
        if n != b:
            raise _invalid(f"{name} has {n} entries but seq_ids has {b}: one per row")
    for row, (pos, com) in enumerate(zip(request.positions, request.committed, strict=True)):
        if pos != com:
            raise _invalid(
                f"row {row}: positions is {pos} but committed is {com}; a window starts "
                "right after the sequence's committed KV"
            )
    hidden = hidden_of(request)
    if hidden is None:
        raise _invalid("the request carries no hidden states")
    if hidden.dtype not in WIRE_DTYPES:
        raise _invalid(
            f"unknown hidden dtype {hidden.dtype} (expected one of "
            f"{', '.join(f'{v} ({k})' for k, v in WIRE_DTYPES.items())})"
        )
    shape = tuple(int(d) for d in hidden.shape)
    if len(shape) != 3 or shape[0] != b or shape[1] < 1 or shape[2] != hidden_size:
        raise _invalid(f"hidden states have shape {shape}, expected ({b}, T, {hidden_size})")
    t = shape[1]
    if t > max_positions:
        raise RowsError(
            "OUT_OF_RANGE", f"window of {t} slots exceeds the context of {max_positions}"
        )
    if b * t * t > MAX_MASK_ELEMENTS:
        raise _invalid(f"{b} rows of {t} slots is too large for one forward: split the batch")
    if len(request.filled) != b * t:
        raise _invalid(f"filled has {len(request.filled)} bytes, expected {b}×{t} = {b * t}")
    kinds = np.frombuffer(request.filled, dtype=np.uint8).reshape(b, t)
    if (kinds > 2).any():
        raise _invalid("filled bytes must be 0 (mask or padding), 1 (filled) or 2 (canvas)")
    widths = np.array(request.widths, dtype=np.int64)
    canvas = _canvas(kinds, widths)
    offsets, extent = _compaction(request, b, t, canvas, widths)
    return RowsSpec(
        seq_ids=[int(s) for s in request.seq_ids],
        starts=np.array(request.committed, dtype=np.int64),
        widths=widths,
        filled=kinds > 0,
        keeps=np.array(request.keep, dtype=np.int64),
        forks=_forks(request, b, max_positions),
        canvas=canvas,
        offsets=offsets,
        extent=extent,
    )


def _compaction(
    request, b: int, t: int, canvas: np.ndarray | None, widths: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A compacted canvas forward's slot offsets and canvas extents, checked."""
    if not request.slot_offsets and not request.canvas_extent:
        return None, None
    if len(request.slot_offsets) != 4 * b * t or len(request.canvas_extent) != b:
        raise _invalid(
            f"slot_offsets must hold {b}×{t} int32 and canvas_extent {b} entries "
            f"(got {len(request.slot_offsets)} bytes, {len(request.canvas_extent)})"
        )
    offsets = np.frombuffer(request.slot_offsets, dtype="<i4").reshape(b, t).astype(np.int64)
    extent = np.array(request.canvas_extent, dtype=np.int64)
    natural = np.arange(t)[None, :]
    counts = canvas if canvas is not None else np.zeros(b, np.int64)
    for row in range(b):
        if counts[row] != widths[row]:  # not a canvas-only row: slots in natural order
            if not (offsets[row] == natural[0]).all():
                raise _invalid(f"row {row}: only canvas-only rows may be compacted")
            continue
        used = offsets[row, : widths[row]]
        if (used < 0).any() or (used >= extent[row]).any():
            raise _invalid(f"row {row}: slot offsets must lie in [0, {int(extent[row])})")
    return offsets, extent


def _canvas(kinds: np.ndarray, widths: np.ndarray) -> np.ndarray | None:
    """[B] canvas slots per row: a row's canvas (bytes 2) is the tail of its width."""
    is_canvas = kinds == 2
    if not is_canvas.any():
        return None
    counts = is_canvas.sum(axis=1)
    for row, (n, w) in enumerate(zip(counts, widths, strict=True)):
        if n and not (0 < w <= kinds.shape[1] and is_canvas[row, w - n : w].all()):
            raise _invalid(f"row {row}: canvas slots (2) must be the last slots of its width")
    return counts.astype(np.int64)


def _forks(request, rows: int, max_positions: int) -> list[tuple[int, int, int]]:
    """The request's forks, each a (new sequence, source, rows) whose length is possible;
    what depends on the KV held here is LayerRunner's check."""
    if len(request.forks) > rows:
        raise _invalid(f"{len(request.forks)} forks for {rows} rows: at most one per row")
    forks = []
    for f in request.forks:
        if not 0 < f.length < max_positions:
            raise _invalid(
                f"fork {f.source} -> {f.seq_id} copies {f.length} rows; a fork copies "
                f"between 1 and {max_positions - 1}"
            )
        forks.append((int(f.seq_id), int(f.source), int(f.length)))
    return forks


def reply_slots(request: pb.ForwardRequest, spec: RowsSpec) -> np.ndarray | None:
    """The slots the reply must carry ([B, S]), or None for every slot."""
    if not request.HasField("reply_rows"):
        return None
    sel = request.reply_rows
    b, t, s = spec.num_rows, spec.width, int(sel.per_row)
    if s > t:
        raise _invalid(f"reply_rows.per_row is {s}, but the window has only {t} slots")
    if len(sel.slots) != b * s:
        raise _invalid(f"reply_rows.slots has {len(sel.slots)} entries, expected {b}×{s} = {b * s}")
    slots = np.array(sel.slots, dtype=np.int32).reshape(b, s)
    if ((slots < 0) | (slots >= t)).any():
        raise _invalid(f"reply_rows.slots must name slots in [0, {t})")
    return slots
