"""benchmarks/dev/stages.py's summary (the numbers each target is read from) and its plot (one
panel per phase that ran and did not fail)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.dev.bench_io import finish_axes

TARGETS = {
    "alone_over_mlxlm_min": 1.0,
    "hop_256KiB_beyond_ms": 0.3,
    "hop_4MiB_beyond_ms": 1.0,
    "gpus2_wedlm_ratio": 1.6,
}


def summary(result: dict) -> dict:
    s: dict = {"required": TARGETS}
    get = lambda phase, *keys: _dig(result.get(phase), keys)  # noqa: E731
    s["alone_over_mlxlm"] = {
        c: v["tok_s"] for c, v in (get("alone", "ours_over_mlxlm") or {}).items()
    }
    s["alone_over_mlxlm_min"] = get("alone", "ours_over_mlxlm_min")
    for kib in ("256", "4096"):
        key = str(int(kib) * 1024)
        s[f"hop_{kib}KiB_beyond_half_echo_ms"] = get("hops", key, "beyond_half_echo_ms")
        s[f"hop_{kib}KiB_beyond_raw_hop_ms"] = get("hops", key, "beyond_raw_hop_ms")
    for mode in ("wedlm", "ar"):
        s[f"gpus2_{mode}_ratio"] = get("gpus2", mode, "ratio")
    s["met"] = _met(s, result)
    s["errors"] = {p: v["error"] for p, v in result.items() if isinstance(v, dict) and "error" in v}
    return s


def _met(s: dict, result: dict) -> dict:
    """Each target that was measured: met or not."""
    t, met = TARGETS, {}
    if s["alone_over_mlxlm_min"] is not None:
        met["alone_over_mlxlm"] = s["alone_over_mlxlm_min"] >= t["alone_over_mlxlm_min"]
    for kib, target in (("256", t["hop_256KiB_beyond_ms"]), ("4096", t["hop_4MiB_beyond_ms"])):
        beyond = s[f"hop_{kib}KiB_beyond_half_echo_ms"]
        if beyond is not None:
            met[f"hop_{kib}KiB"] = beyond <= target
    if s["gpus2_wedlm_ratio"] is not None:
        met["gpus2_wedlm"] = s["gpus2_wedlm_ratio"] >= t["gpus2_wedlm_ratio"]
    return met


def _dig(value, keys):
    for k in keys:
        if not isinstance(value, dict) or k not in value:
            return None
        value = value[k]
    return value


def _ok(result: dict, phase: str) -> dict | None:
    data = result.get(phase)
    return (
        data if isinstance(data, dict) and "error" not in data and "skipped" not in data else None
    )


def _alone(ax, data: dict) -> None:
    cs = sorted(data["ours"], key=int)
    for side, label, style in (
        ("ours", "coordinator alone", "o-"),
        ("mlxlm", "mlx-lm BatchGenerator", "s--"),
    ):
        ax.plot(
            [int(c) for c in cs], [data[side][c]["tok_s"] or np.nan for c in cs], style, label=label
        )
    for c in cs:
        r = data["ours_over_mlxlm"][c]["tok_s"]
        if r is not None:
            ax.annotate(
                f"{r:.2f}×",
                (int(c), data["ours"][c]["tok_s"] or 0),
                fontsize=8,
                textcoords="offset points",
                xytext=(4, 6),
            )
    finish_axes(ax, "concurrent requests (AR)", "aggregate tok/s", xs=[int(c) for c in cs])
    ax.set_title("1: coordinator alone vs mlx-lm (target ≥ 1.0×)")


def _hops(ax, data: dict) -> None:
    sizes = sorted(int(k) for k in data if k.isdigit())
    kib = [s / 1024 for s in sizes]
    for key, label, style in (
        ("hop_ms", "relay hop (B − A)", "o-"),
        ("raw_hop_ms", "grpcio raw relay hop", "s--"),
        ("echo_ms", "grpcio echo (round trip)", "^:"),
        ("beyond_half_echo_ms", "relay hop − echo/2", "d-"),
    ):
        ax.plot(kib, [data[str(s)][key] for s in sizes], style, label=label)
    for s in sizes:
        if "target_ms" in data[str(s)]:
            ax.plot(s / 1024, data[str(s)]["target_ms"], "r*", ms=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(
        xlabel="payload (KiB)",
        ylabel="ms (median)",
        title="3: per relay hop, worker to worker (★ targets)",
    )
    ax.legend(fontsize=8)


def _gpus2(ax, data: dict) -> None:
    modes = ["wedlm", "ar"]
    x = np.arange(2)
    ax.bar(
        x - 0.2,
        [data[m]["alone_tok_s"] or np.nan for m in modes],
        0.4,
        label="coordinator alone, 1 GPU",
    )
    ax.bar(
        x + 0.2,
        [data[m]["two_stages_tok_s"] or np.nan for m in modes],
        0.4,
        label="coordinator + 1 worker, 2 GPUs",
    )
    ax.set_xticks(x, [f"{m} ({data[m]['ratio']}×)" for m in modes])
    ax.set(ylabel="aggregate tok/s", title=f"4: C = {data['concurrency']}, target WeDLM ≥ 1.6×")
    ax.legend(fontsize=8)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (p, f)
        for p, f in (
            ("alone", _alone),
            ("hops", _hops),
            ("gpus2", _gpus2),
        )
        if _ok(result, p)
    ]
    if not panels:
        return
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax, (phase, draw) in zip(axes.flat, panels, strict=False):
        draw(ax, result[phase])
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        f"{result['model']} on {result['device']} ({result.get('date', '')}, "
        f"code {result.get('commit')})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
