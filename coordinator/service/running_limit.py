"""How many sequences the coordinator decodes at once when --max-running is not given.

Admission already holds each request's worst-case KV against the measured budget, so this
number bounds the decode batch, not memory: it should be as large as the machine's memory
lets typical requests run side by side (a larger batch costs a decode step little more,
and a request beyond it waits in the queue: at C = 32 a limit of 16 lost to mlx_lm.server,
64 beat it 1.38x, RESULTS.md issue 25), within the row buckets the warm-up compiles
(forward_shapes.BUCKETS)."""

from __future__ import annotations

from coordinator.engine.forward_shapes import BUCKETS

AUTO_MAX_RUNNING = 64  # the largest default: a row bucket the warm-up covers
TYPICAL_PROMPT_TOKENS = 512  # with the default max_tokens: a typical request's KV need


def auto_max_running(
    kv_tokens: int | None, default_max_tokens: int, forward_rows: int
) -> tuple[int, str]:
    """The number of sequences to decode at once, and why (for the log and `wedlm status`)."""
    if kv_tokens is None:
        return AUTO_MAX_RUNNING, f"{AUTO_MAX_RUNNING} (the default; free memory not measured)"
    need = TYPICAL_PROMPT_TOKENS + default_max_tokens + forward_rows
    fits = kv_tokens // need
    if fits >= AUTO_MAX_RUNNING:
        return AUTO_MAX_RUNNING, (
            f"{AUTO_MAX_RUNNING}: the largest default (the KV budget of {kv_tokens:,} tokens "
            f"holds {fits} typical requests of {need:,})"
        )
    n = max([b for b in BUCKETS if b <= fits] or [1])
    return n, (
        f"{n}: what memory holds (the KV budget of {kv_tokens:,} tokens holds {fits} typical "
        f"requests of {need:,}: a {TYPICAL_PROMPT_TOKENS}-token prompt and the default "
        f"max_tokens {default_max_tokens:,}); --max-running sets it"
    )
