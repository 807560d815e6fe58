"""A speculative request's draft state (draft_policy.py reads and writes it): below both
the sequence that holds it and the policy, so neither imports the other's dependants."""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 8  # forwards from drafts turning off to the first probe
PROBE_MAX = 128  # the longest gap between probes


@dataclass
class DraftState:
    gain: float | None = None  # EMA of tokens committed per drafting forward (this spell)
    gap: int = PROBE_EVERY  # forwards between probes while drafts are off
    next_probe: int = 0  # the forward number (Sequence.forwards) of the next probe
    paid: bool = True  # drafting paid since it last resumed (the first spell counts as paid)
    # a mask probe's confident guess, checked when the output reaches its index:
    # (output index, token)
    shadow: tuple[int, int] | None = None
