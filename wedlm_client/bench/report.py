"""What every `wedlm bench` subcommand does with its result: label it with the machine and
the cluster it measured, print a table, write JSON and a PNG, and show progress on stderr
(never on stdout, which may carry the JSON)."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = 1


class Progress:
    """One line per step on stderr; on a terminal the line is rewritten in place."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.what, self.done = max(total, 1), what, 0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        line = (f"[{self.what} {self.done}/{self.total} {time.monotonic() - self.t0:.0f} s] "
                f"{label}")  # fmt: skip
        if self.tty:
            end = "\n" if self.done >= self.total else ""
            sys.stderr.write(f"\r\033[K{line}{end}")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        sys.stderr.write(("\n" if self.tty else "") + text + "\n")
        sys.stderr.flush()


def machine() -> dict[str, str]:
    """Where the load generator ran (the servers' machines are in the cluster label)."""
    return {"host": platform.node(), "system": f"{platform.system()} {platform.release()}",
            "machine": platform.machine(), "python": platform.python_version()}  # fmt: skip


def cluster_label(address: str, timeout: float = 10.0) -> dict[str, Any]:
    """Model, members, chips and plan of the cluster at a coordinator's gRPC address; what
    went wrong instead when it cannot be read (a result file still says what it measured)."""
    from wedlm_client.client import ClusterError, WedlmClient

    try:
        with WedlmClient(address, timeout) as client:
            status, info = client.status_dict(), client.model_info()
    except ClusterError as e:
        return {"address": address, "error": str(e)}
    members = [{"address": "coordinator", "layers": status.get("local_layers", "")}]
    for w in status.get("workers", []):
        wi = w.get("info", {})
        members.append({
            "address": w.get("address", ""), "node_id": wi.get("node_id", ""),
            "device": wi.get("device", ""), "health": w.get("health", ""),
            "layers": f"{wi.get('layer_start', 0)}-{wi.get('layer_end', 0)}"
            if wi.get("has_layers") else "",
            "memory_total": int(wi.get("memory_total", 0)),
        })  # fmt: skip
    return {
        "address": address, "cluster": status.get("cluster", ""),
        "model": info.model_name, "model_type": info.model_type,
        "layers": info.num_layers, "hidden": info.hidden_size,
        "state": status.get("state", ""), "plan_epoch": int(status.get("plan_epoch", 0)),
        "default_mode": status.get("default_mode", ""),
        "chips": sorted({m["device"] for m in members if m.get("device")}),
        "members": members,
    }  # fmt: skip


def header(command: str, args_used: dict) -> dict[str, Any]:
    return {"tool": f"wedlm bench {command}", "schema": SCHEMA,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "load_generator": machine(),
            "args": args_used}  # fmt: skip


def shown(v: Any) -> str:
    """A value for a person: nothing measured shows as 'n/a' (never 'None'), floats with at
    most 2 decimals."""
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def table(columns: list[str], rows: list[list[Any]]) -> str:
    """A plain text table of shown() values; "" leaves a cell blank."""
    text = [[shown(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in text)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in text]
    return "\n".join(lines)


def figure(ncols: int, title: str):
    """A figure with `ncols` panels, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
    fig.suptitle(title, fontsize=9)
    return fig, list(axes[0])


def finish_axes(ax, xlabel: str, ylabel: str, xs: list[int] | None = None) -> None:
    """Labels, a grid, a legend when there is one, y from 0; `xs` (concurrency levels): a
    log2 x axis with a tick at each."""
    if xs is not None:
        if len(xs) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(xs), [str(c) for c in sorted(xs)])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def save_figure(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def emit(result: dict, text: str, out: Path, stem: str, as_json: bool) -> None:
    """Write the JSON file, then stdout: the JSON object (--json) or the table."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    result["files"] = {**result.get("files", {}), "json": str(path)}
    path.write_text(json.dumps(result, indent=1))
    if as_json:
        print(json.dumps(result))
    else:
        print(text)
        print(f"\nwrote {', '.join(result['files'].values())}")
