"""What a drafting forward costs against an AR forward, on this machine and model: the
break-even of speculative drafts (draft_policy.py). A micro-batch of B rows drafts only
while its rows together commit more tokens per drafting forward, per row, than
break_even(B).

It depends on the backend and the model, so it is measured, not assumed: on MLX-CUDA with a
135M model a forward of several rows costs 2-3x a one-row one (RESULTS.md, SC3); on a Mac
with a weight-bound model about 1x. Seeded by `measure_step_cost` (warm-up, benchmarks) per
row bucket, then refined online from the engine's own forwards: the wall time of a decode
forward whose rows are all one-row (AR, launched ahead) against one carrying drafts, as
medians of the last ONLINE_WINDOW forwards of each kind per row bucket (one micro-batch in
flight only: a pipeline's overlapping forwards show no forward's own time, so a pipeline
of stages is measured before readiness instead, warmup.py). Medians, not averages: one
drafting forward that compiles a new shape can take a second, and an average seeded by it
(as this was) priced drafts at 175 AR forwards for good on an H100 (RESULTS.md SC8), after
which no drafting forward came to correct it. Unknown (nothing measured yet) is 1.0:
drafts pay when anything is accepted."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from coordinator.engine.forward_shapes import row_bucket

AR, DRAFT = "ar", "draft"
ONLINE_WINDOW = 64  # the newest forwards of each kind whose median is the online figure
ONLINE_MIN = 8  # forwards of each kind seen before the online figure replaces the seed


@dataclass
class StepCost:
    seeded: dict[int, float] = field(default_factory=dict)  # row bucket → measured ratio
    online: bool = True  # refine from the engine's forwards (observe)
    _recent: dict[tuple[str, int], deque[float]] = field(default_factory=dict)

    def seed(self, ratios: dict[int, float]) -> None:
        """Measured break-evens per row bucket (measure_step_cost); the online figures
        start again from them."""
        self.seeded.update(ratios)
        self._recent.clear()

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        """One decode forward of `rows` sequences took `seconds` (kind AR or DRAFT)."""
        if not self.online or seconds <= 0:
            return
        key = (kind, row_bucket(rows))
        self._recent.setdefault(key, deque(maxlen=ONLINE_WINDOW)).append(seconds)

    def break_even(self, rows: int) -> float:
        """What a drafting forward of `rows` sequences costs in AR forwards (at least 1)."""
        bucket = row_bucket(max(rows, 1))
        ar, draft = self._recent.get((AR, bucket), ()), self._recent.get((DRAFT, bucket), ())
        if min(len(ar), len(draft)) >= ONLINE_MIN:
            return max(1.0, statistics.median(draft) / statistics.median(ar))
        measured = [b for b in self.seeded if b <= bucket] or sorted(self.seeded)[:1]
        return max(1.0, self.seeded[max(measured)]) if measured else 1.0

    def describe(self) -> dict[int, float]:
        """The break-even per row bucket known now (measured or online), for logs and stats."""
        buckets = set(self.seeded) | {b for _, b in self._recent}
        return {b: round(self.break_even(b), 3) for b in sorted(buckets)}
