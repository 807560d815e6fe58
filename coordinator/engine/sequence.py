"""One request's token state: everything the coordinator needs to continue or rebuild it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from common.generation_params import GenerationParams
from coordinator.engine.draft_state import DraftState
from coordinator.engine.prefix_cache import PrefixHit


class Phase(Enum):
    """Where a sequence is; the four last are its end, and say why it ended. Only the
    schedulers (scheduler.py, diffusion/scheduler.py) change it."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    STOPPED = "stop"  # a stop id or stop string
    LENGTH = "length"  # max_tokens, or the model's context
    ABORTED = "aborted"  # the client, a deadline or a shutdown (Sequence.abort_reason)
    ERROR = "error"  # a forward failed and could not be mended

    @property
    def finished(self) -> bool:
        return self in _ENDS


_ENDS = frozenset({Phase.STOPPED, Phase.LENGTH, Phase.ABORTED, Phase.ERROR})


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: GenerationParams
    output: list[int] = field(default_factory=list)  # committed completion tokens
    phase: Phase = Phase.WAITING
    kv_length: int = 0  # rows of permanent KV (prompt + committed, minus AR's last token)
    prefilled: int = 0  # prompt tokens already in the KV
    rebuild_to: int = 0  # > 0 while re-prefilling committed history after a worker loss
    prefix: PrefixHit | None = None  # the cached rows it starts from (prefix cache)
    cached_tokens: int = 0  # prompt tokens whose KV was copied (prefix cache or share_from)
    # n > 1: the choice whose prompt rows this one copies once they are in the KV
    # (prompt_sharing.py); None once its fork has run, or when it prefills on its own.
    share_from: Sequence | None = field(default=None, repr=False)
    shared_tokens: int = 0  # prompt tokens whose KV was copied from share_from
    # WeDLM window, in logical slot order: slot i sits at position kv_length + i.
    window_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    window_filled: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    # Speculative mode: the drafts its next forward verifies, and what became of drafts
    drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    drafted: int = 0  # draft tokens verified so far
    draft_forwards: int = 0  # forwards that carried drafts or mask slots (the rest: AR's)
    # How many drafts its next forward may verify, adapted to its recent acceptance
    # and its cost (draft_policy.py); None: the window, until a forward has been verified.
    draft_limit: int | None = None
    draft_state: DraftState = field(default_factory=DraftState)  # gain EMA, probe back-off
    accepted: int = 0  # of which equalled the model's own choice (committed)
    forwards: int = 0  # forwards that produced tokens for this sequence
    canvas: Any = None  # diffusion mode: the canvas being denoised (diffusion/canvas.py)
    canvases: int = 0  # diffusion mode: canvases committed so far
    abort_reason: str = ""  # why an ABORTED sequence was aborted ("cancelled", "deadline")
    warning: str = ""  # why its decoding may be degraded on this checkpoint (mode_warning)
    prefill_s: float = 0.0  # wall time from its first prefill launch to the prompt's end
    decode_s: float = 0.0  # wall time from its first decode launch to its last commit
    prefill_started: float | None = None
    decode_started: float | None = None
    text_tail: Callable[[list[int]], str] | None = field(default=None, repr=False)
    # params.logprobs: chosen tokens' logprobs by output index until they commit
    token_logprobs: dict[int, Any] = field(default_factory=dict, repr=False)
    # params.prompt_logprobs: the prompt's tokens' logprobs by prompt index (a re-prefill
    # overwrites them alike), handed out with its first commit (token_logprobs.attach)
    prompt_logprobs: dict[int, Any] | None = field(default_factory=dict, repr=False)
    matcher: Any = field(default=None, repr=False)  # params.grammar's state (constrained.py)

    @property
    def finished(self) -> bool:
        return self.phase in _ENDS

    @property
    def finish_reason(self) -> str | None:
        """Why it ended, as the APIs say it ("stop", "length", "error", or the abort's
        reason); None while it runs."""
        if self.phase not in _ENDS:
            return None
        if self.phase is Phase.ABORTED:
            return self.abort_reason or "cancelled"
        return self.phase.value

    def prefill_tokens(self) -> list[int]:
        """What prefill must put into the KV: the prompt, or after a worker loss the whole
        committed history (prompt + output up to the KV length it had)."""
        if self.rebuild_to:
            return (self.prompt + self.output)[: self.rebuild_to]
        return self.prompt

    def restart_prefill(self) -> None:
        """Forget the KV (its worker is gone); keep tokens, window and counters. The
        scheduler moves it back to PREFILL."""
        if self.phase is Phase.DECODE:
            self.rebuild_to = self.kv_length
        self.kv_length = 0
        self.prefilled = 0
        self.prefix = None  # the cache is dropped with the stages' KV: all is rebuilt
        self.cached_tokens = self.shared_tokens = 0
        self.share_from = None
        if self.canvas is not None:  # diffusion: the canvas goes on, its K/V is gone
            self.canvas.restart()

    def start_from(self, hit: PrefixHit) -> None:
        """Start with `hit.length` prompt rows already in the KV (copied from the cache
        by the first forward)."""
        self.prefix = hit
        self.kv_length = self.prefilled = self.cached_tokens = hit.length

    def cacheable(self) -> list[int] | None:
        """The tokens whose KV the stages hold for this finished sequence, or None when
        they hold none that can be trusted (it failed, or its fork never ran)."""
        if self.phase is Phase.ERROR or (self.prefix is not None and not self.prefix.sent):
            return None
        return (self.prompt + self.output)[: self.kv_length]

    def pending(self) -> list[int]:
        """Committed tokens whose KV is not stored yet (AR and speculative mode): the last
        one, plus the drafts a speculative forward accepted (their KV is recomputed with the
        next forward's rows, as WeDLM commits its filled run)."""
        return self.output[max(self.kv_length - len(self.prompt), 0) :]

    def leading_filled(self) -> int:
        """p: the number of filled slots before the first mask (all of them if no mask)."""
        masks = np.flatnonzero(~self.window_filled)
        return int(masks[0]) if masks.size else int(self.window_filled.size)

    def ending(self, tokens: list[int]) -> tuple[int, Phase | None]:
        """How many of `tokens` a commit takes (up to the first that ends the sequence: a
        stop id, a stop string or max_tokens) and the phase it ends in (None: it goes on).
        Nothing changes."""
        stop_ids = self.params.all_stop_ids
        strings = self.params.stop_strings if self.text_tail is not None else ()
        done = len(self.output)
        for i, token in enumerate(tokens, 1):
            if token in stop_ids or (strings and self._stop_string_in(tokens[:i])):
                return i, Phase.STOPPED
            if done + i >= self.params.max_tokens:
                return i, Phase.LENGTH
        return len(tokens), None

    def commit(self, tokens: list[int]) -> Phase | None:
        """Append what `ending` takes of `tokens`; returns the phase the sequence ends in
        (None: it goes on), for its scheduler to set."""
        taken, end = self.ending(tokens)
        self.output.extend(int(t) for t in tokens[:taken])
        return end

    def _stop_string_in(self, new: list[int]) -> bool:
        """Whether the text ends with a stop string once `new` follows the output."""
        strings = self.params.stop_strings
        longest = max(len(s) for s in strings) + 4
        ids = (self.output[-longest:] + [int(t) for t in new])[-longest:]
        tail = self.text_tail(ids)
        return any(s in tail for s in strings)
