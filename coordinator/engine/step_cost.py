"""What a drafting forward costs against an AR forward, on this machine and model: the
break-even of speculative drafts (draft_policy.py). A micro-batch of B rows drafts only
while its rows together commit more tokens per drafting forward, per row, than
break_even(B).

It depends on the backend and the model, so it is measured, not assumed: on MLX-CUDA with a
135M model a forward of several rows costs 2-3x a one-row one (RESULTS.md, SC3); on a Mac
with a weight-bound model about 1x. Seeded by `measure_step_cost` (warm-up, benchmarks) per
row bucket, then refined online from the engine's own forwards: the wall time of a decode
forward whose rows are all one-row (AR, launched ahead) against one carrying drafts, as
EMAs per row bucket (one micro-batch in flight only: a pipeline's overlapping forwards
show no forward's own time, so a pipeline of stages is measured before readiness instead,
warmup.py). Unknown (nothing measured yet) is 1.0: drafts pay when anything is accepted."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.engine.forward_shapes import row_bucket

AR, DRAFT = "ar", "draft"
ONLINE_WEIGHT = 0.05  # of the newest forward's time in the online EMAs
ONLINE_MIN = 8  # forwards of each kind seen before the online figure replaces the seed


@dataclass
class StepCost:
    seeded: dict[int, float] = field(default_factory=dict)  # row bucket → measured ratio
    online: bool = True  # refine from the engine's forwards (observe)
    _ema: dict[tuple[str, int], float] = field(default_factory=dict)
    _seen: dict[tuple[str, int], int] = field(default_factory=dict)

    def seed(self, ratios: dict[int, float]) -> None:
        """Measured break-evens per row bucket (measure_step_cost); the online figures
        start again from them."""
        self.seeded.update(ratios)
        self._ema.clear()
        self._seen.clear()

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        """One decode forward of `rows` sequences took `seconds` (kind AR or DRAFT)."""
        if not self.online or seconds <= 0:
            return
        key = (kind, row_bucket(rows))
        old = self._ema.get(key)
        self._ema[key] = seconds if old is None else old + ONLINE_WEIGHT * (seconds - old)
        self._seen[key] = self._seen.get(key, 0) + 1

    def break_even(self, rows: int) -> float:
        """What a drafting forward of `rows` sequences costs in AR forwards (at least 1)."""
        bucket = row_bucket(max(rows, 1))
        ar, draft = (AR, bucket), (DRAFT, bucket)
        if min(self._seen.get(ar, 0), self._seen.get(draft, 0)) >= ONLINE_MIN:
            return max(1.0, self._ema[draft] / self._ema[ar])
        measured = [b for b in self.seeded if b <= bucket] or sorted(self.seeded)[:1]
        return max(1.0, self.seeded[max(measured)]) if measured else 1.0

    def describe(self) -> dict[int, float]:
        """The break-even per row bucket known now (measured or online), for logs and stats."""
        buckets = set(self.seeded) | {b for _, b in self._seen}
        return {b: round(self.break_even(b), 3) for b in sorted(buckets)}
