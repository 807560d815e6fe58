"""What mode "auto" decodes with on this machine. A WeDLM-trained checkpoint decodes with
WeDLM where a wide forward costs about what a one-row one does (a Mac's GPU, a CUDA GPU:
the weights are read once for every row). Where a wide forward costs many one-row forwards
(MLX's CPU backend multiplies quantized weights row by row: a 10-row forward measured 14x
a one-row one on 2 x86 cores), WeDLM's windows commit fewer tokens per second than AR, so
auto decodes with AR there. An explicit `mode: wedlm` still runs WeDLM.

A family with recurrent layers (linear attention, Mamba) decodes with AR whatever its
checkpoint says: its state cannot take back the rows WeDLM and drafts write and reject."""

from __future__ import annotations

from common.modes import Mode

# A drafting forward of 10 rows (step_timing.py) costing more than this many one-row
# forwards makes auto choose AR: WeDLM's 16-32-row windows would then have to commit more
# than ~6 tokens per forward to keep up, which only raw counting does (the r2 checkpoint:
# 3.8 on counting lists, 1.2 on chat). On an H200 the ratio is 1.3-3, on a Mac about 1.
WIDE_COST_FOR_AR = 6.0


def auto_mode(checkpoint_mode: str, wide_cost: float | None) -> tuple[str, str]:
    """(the mode auto decodes with, why in a sentence or "") from the checkpoint's own
    mode and what a drafting forward costs in one-row forwards (None: not measured)."""
    if checkpoint_mode != Mode.WEDLM or wide_cost is None or wide_cost <= WIDE_COST_FOR_AR:
        return checkpoint_mode, ""
    return Mode.AR, (
        f"mode auto decodes with AR, not WeDLM: on this machine a 10-row forward costs "
        f"{wide_cost:.1f} one-row forwards (more than {WIDE_COST_FOR_AR:g}), so WeDLM's "
        f"windows would commit fewer tokens per second than AR; a request that names "
        f"mode wedlm still gets WeDLM"
    )


def family_mode(checkpoint_mode: str, recurrent: bool) -> str:
    """The checkpoint's own mode as its family allows it: AR where layers keep recurrent
    state (no mode that writes rows and takes some back)."""
    return (
        Mode.AR
        if recurrent and checkpoint_mode in (Mode.WEDLM, Mode.SPECULATIVE)
        else checkpoint_mode
    )


def refused_mode(mode: str, family: str, recurrent: bool, sliding: bool = False) -> str | None:
    """Why `mode` cannot decode this family (None: it can)."""
    if recurrent and mode in (Mode.WEDLM, Mode.SPECULATIVE):
        return (
            f"mode {mode} is not served for {family}: it has recurrent layers (linear "
            f"attention or state-space), whose state cannot take back the rows that "
            f"{'WeDLM windows' if mode == 'wedlm' else 'rejected drafts'} write (use mode ar)"
        )
    if sliding and mode == Mode.WEDLM:
        # a window's slots are reordered (committed and filled first), and the sliding
        # mask counts slots, not logical positions: near a window's edge it would be off
        return (
            f"mode wedlm is not served for {family}: it has sliding-window or chunked "
            f"attention layers, whose masks WeDLM's reordered windows do not keep yet "
            f"(use mode ar or speculative)"
        )
    return None
