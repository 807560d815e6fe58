"""Padding rows: row counts are padded to buckets (bounded shapes), and each unit's padding
rows get ids of their own on the stages; the ones a unit stops using are released."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.engine.forward_shapes import row_bucket
from coordinator.engine.scheduler import PREFILL, Unit


class PaddingRows:
    def __init__(self) -> None:
        self._ids: dict[Unit, set[int]] = {}  # padding rows each unit holds on the stages

    def ids_for(self, unit: Unit, rows: int, release: Callable[[list[int]], None]) -> list[int]:
        """The padding ids of a forward of `rows` rows of `unit`; `release` drops the
        ones it no longer uses (a reused id starts at 0 and keeps nothing)."""
        pad = row_bucket(rows) - rows
        base = (1 << 62) + (0 if unit is PREFILL else unit + 1) * 4096
        ids = {base + i for i in range(pad)}
        stale = self._ids.get(unit, set()) - ids
        if stale:
            release(sorted(stale))
        self._ids[unit] = ids
        return sorted(ids)

    def take_all(self) -> list[int]:
        """Every padding id held, forgotten here (the caller releases them or they are
        gone with the stages)."""
        held = sorted(i for ids in self._ids.values() for i in ids)
        self._ids.clear()
        return held
