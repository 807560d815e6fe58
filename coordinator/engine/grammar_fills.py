"""The grammar masks of structured-output rows, filled where they cost least: inline before
sampling (the default), or on the grammars' thread while the host does other work
(`fill_ahead`: RESULTS.md GC2 found the thread cost more than it hid on an H100). Owns the
one fill in flight and the tokens its matchers took early; the engine calls it at fixed
points of its tick."""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future

import numpy as np

from common.modes import Mode
from coordinator.engine import constrained
from coordinator.engine.in_flight import InFlight
from coordinator.engine.row_plan import RowPlan


class GrammarFills:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.grammars: constrained.Grammars | None = None
        self.fill_ahead = False
        self._fill: tuple[int, Future[constrained.Masks]] | None = None
        self.cut: set[int] = set()  # sequences whose run the grammar cut at the last step
        self._taken: dict[int, int] = {}  # seq id -> the token its matcher took early

    def start(self, in_flight: deque[InFlight]) -> None:
        """Start filling the grammar masks of the oldest forward in flight on the grammars'
        thread, where its plans are known and its matchers have taken every committed
        token: the fill (llguidance, without the GIL) then overlaps this thread's work
        until sampling applies it. Nothing else touches those matchers meanwhile: advance
        runs after that forward's read-back has taken the fill."""
        if self.grammars is None or not self.fill_ahead or self._fill is not None:
            return
        if not in_flight or in_flight[0].batch is None:
            return  # an unresolved look-ahead: started once its plans are named
        flight = in_flight[0]
        k = flight.batch.head_slots.shape[1]
        job = constrained.mask_job(flight.plans, k, self.vocab_size) if k else None
        if job is not None:
            future = self.grammars.filler.submit(
                constrained.fill_masks, job, self.grammars.executor
            )
            self._fill = (flight.batch_id, future)

    def take(self, batch_id: int) -> Future[constrained.Masks] | None:
        """The fill started for forward `batch_id`, if any. One started for a forward that
        was dropped since (a restart) is waited for: its matchers are then left alone."""
        pending, self._fill = self._fill, None
        if pending is None or pending[0] == batch_id:
            return pending and pending[1]
        with contextlib.suppress(Exception):
            pending[1].result()
        return None

    def fill_early(self, flight: InFlight, in_flight: deque[InFlight], tokens: np.ndarray) -> None:
        """The masks of an autoregressive look-ahead forward, started before this step's
        postprocess: a constrained AR row commits its sampled token or finishes (and its
        next row is never read), so its matcher takes the token on the grammars' thread,
        which then fills the next forward's masks while postprocess runs."""
        if self.grammars is None or not self.fill_ahead or self._fill is not None:
            return
        nxt = in_flight[0]
        if nxt is not in_flight[-1]:
            return  # another micro-batch completes before the look-ahead
        rows = [
            (i, p.seq) for i, p in enumerate(flight.plans)
            if p.seq.matcher is not None and not p.seq.finished and not p.seq.matcher.is_error()
        ]  # fmt: skip
        if not rows or any(seq.params.mode != Mode.AR for _, seq in rows):
            return
        job = constrained.mask_job(nxt.plans, nxt.batch.head_slots.shape[1], self.vocab_size)
        if job is None:
            return
        self._taken = {seq.seq_id: int(tokens[i, 0]) for i, seq in rows}
        taken = [(seq.matcher, self._taken[seq.seq_id]) for _, seq in rows]
        future = self.grammars.filler.submit(
            constrained.take_and_fill, taken, job, self.grammars.executor
        )
        self._fill = (nxt.batch_id, future)

    def advance(self, plans: list[RowPlan], before: list[int]) -> None:
        """After postprocess: the matchers take the committed tokens (those that took theirs
        early are checked instead); `cut` names the rows whose run the grammar cut."""
        self._check_taken(plans, before)
        self.cut = constrained.advance(plans, before, frozenset(self._taken))
        self._taken = {}

    def _check_taken(self, plans: list[RowPlan], before: list[int]) -> None:
        """A row whose matcher took its token early (fill_early) and then committed
        something else without finishing (not expected: an AR row commits its token or
        ends) gets its matcher corrected here, and the early fill is dropped."""
        wrong = [
            p.seq for p, start in zip(plans, before, strict=True)
            if p.seq.seq_id in self._taken and not p.seq.finished
            and p.seq.output[start:] != [self._taken[p.seq.seq_id]]
        ]  # fmt: skip
        if not wrong:
            return
        self.take(-1)  # waited for, then dropped: the next forward fills inline
        for seq in wrong:
            seq.matcher.rollback(1)
            del self._taken[seq.seq_id]
