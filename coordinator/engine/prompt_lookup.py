"""Prompt lookup drafts: continue the text the way it continued the last time its final
tokens occurred (strong when the output copies from the prompt: editing, summaries, code)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

LOOKUP_MAX_NGRAM = 3  # prompt lookup matches the last 3, then 2, then 1 tokens


def prompt_lookup(history: np.ndarray, count: int, max_ngram: int = LOOKUP_MAX_NGRAM) -> np.ndarray:
    """Up to `count` tokens that followed the latest earlier occurrence of the history's
    last n tokens (n = max_ngram down to 1); empty when nothing matches."""
    history = np.asarray(history, dtype=np.int32)
    size = history.size
    if count <= 0:
        return history[:0]
    for n in range(min(max_ngram, size - 1), 0, -1):
        tail = history[size - n :]
        # candidate starts i < size - n, so at least one token follows each match
        windows = sliding_window_view(history[: size - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return history[start : start + count].copy()
    return history[:0]
