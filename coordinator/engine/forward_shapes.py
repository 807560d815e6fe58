"""The shapes of the forwards the engine launches, and why their set is bounded.

A new forward shape costs MLX a new kernel set (and a new graph on CUDA), so the first forward
of each shape stalls. Three rules keep the set finite, and they live here together:
- rows (sequences plus padding rows) are padded to a few buckets (`row_bucket`);
- window widths T are padded to a few widths (`padded_width`): multiples of WIDTH_STEP up to
  WIDE_FROM (AR rows are 1 wide, WeDLM windows W + p <= 2 * MAX_WINDOW), then multiples of
  WIDE_STEP up to the prefill chunk;
- attention spans are rounded up to SPAN_STEP (common/kv_rows.py).
A forward's shape key is (rows, T, span): `ForwardShapes` records the keys the engine runs and
`ShapeLimits.bound()` counts every key that the rules allow, so "bounded" is a checked formula.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.kv_rows import SPAN_STEP
from common.rows_spec import RowsSpec

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WIDTH_STEP = 8  # window widths up to WIDE_FROM are padded to multiples of this
WIDE_FROM = 128  # 2 * MAX_WINDOW: every WeDLM window fits below it
WIDE_STEP = 64  # wider (prefill) chunks are padded to multiples of this

ShapeKey = tuple[int, int, int]  # (rows incl. padding, window width T, span rounded up)


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def row_bucket(rows: int) -> int:
    for b in BUCKETS:
        if rows <= b:
            return b
    return round_up(rows, 64)


def padded_width(width: int) -> int:
    """The width a forward runs with when its widest row has `width` slots. Padding slots
    are unfilled and seen by no real slot; their KV lies past the committed length.
    Trade-off: a lone prompt chunk wastes up to 7 slots (63 past WIDE_FROM) and, unless its
    length is already in the set, takes the explicit-mask path instead of mlx-lm's causal
    fast path; in exchange a prompt length is never a new shape."""
    if width <= 1:
        return width
    return round_up(width, WIDTH_STEP if width <= WIDE_FROM else WIDE_STEP)


def shape_key(spec: RowsSpec) -> ShapeKey:
    """The span is that of KVRows.begin: the furthest row's window end, rounded up (the
    uniform causal fast path attends over the exact span; its key rounds it as well)."""
    end = int(spec.starts.max()) + spec.width if spec.num_rows else spec.width
    return spec.num_rows, spec.width, round_up(end, SPAN_STEP)


@dataclass(frozen=True)
class ShapeLimits:
    """What bounds the shapes: rows of one micro-batch (max_running), the widest row
    (max(prefill_chunk, MAX_FORWARD_ROWS)) and the model's context."""

    max_rows: int
    max_width: int
    max_positions: int

    def rows(self) -> list[int]:
        return sorted({row_bucket(n) for n in range(1, self.max_rows + 1)})

    def widths(self) -> list[int]:
        return sorted({padded_width(t) for t in range(1, self.max_width + 1)})

    def spans(self, width: int) -> range:
        """Spans a forward of this padded width can have: its furthest row starts at most at
        max_positions - 1 (every row's start + own width stays within the context), so the
        end is in [width, max_positions - 1 + width]."""
        last = round_up(self.max_positions - 1 + width, SPAN_STEP)
        return range(round_up(width, SPAN_STEP), last + 1, SPAN_STEP)

    def admits(self, key: ShapeKey) -> bool:
        rows, width, span = key
        return rows in self.rows() and width in self.widths() and span in self.spans(width)

    def bound(self) -> int:
        """|row buckets| x sum over padded widths T of |spans of T|, i.e.
        |R| * sum_T (ceil((P - 1 + T) / S) - ceil(T / S) + 1) with S = SPAN_STEP."""
        return len(self.rows()) * sum(len(self.spans(t)) for t in self.widths())


class ForwardShapes:
    """The distinct shape keys of the forwards run so far (engine and warm-up)."""

    def __init__(self) -> None:
        self.seen: set[ShapeKey] = set()

    def record(self, spec: RowsSpec) -> bool:
        """Note this forward's shape; True when it is new."""
        key = shape_key(spec)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    @property
    def count(self) -> int:
        return len(self.seen)

    def __contains__(self, key: ShapeKey) -> bool:
        return key in self.seen
