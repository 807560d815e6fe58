"""The HTTP phase of benchmarks/dev/serve.py: the same closed loop over the OpenAI-compatible
HTTP API (the official `openai` package, streaming /v1/completions with usage) and over
gRPC (WedlmClient), on one coordinator, level by level and side by side, the order of
the two swapped every round. The clients run in several processes, so that the load
generator's own Python (the `openai` package parses every chunk with pydantic) is not
what is measured.

tok/s here counts the completion tokens of requests that finished inside the measured
window, for both sides alike (an HTTP chunk does not say how many tokens it carries);
TTFT is the first chunk with text (HTTP) or the first token event (gRPC).
"""

from __future__ import annotations

import re
import sys

import numpy as np

from benchmarks.dev.bench_io import ratio
from wedlm_client.bench.clients import OpenAIRequest, openai_thread
from wedlm_client.bench.load import client_pool
from wedlm_client.bench.load import level as load_level

__all__ = ["OpenAIRequest", "http_url_of", "http_vs_grpc", "level", "openai_thread"]


def level(
    pool, processes: int, kind: str, target: str, model: str, c: int, params, args, label=None
) -> dict:
    """The tool's level (wedlm_client/bench/load.py) under this script's key names:
    tok_s_ended / tok_s_finished (both: requests that ended in the window), errors."""
    stats = load_level(pool, processes, kind, target, model, c, params, args.duration,
                       args.warmup)  # fmt: skip
    stats["tok_s_ended"] = stats["tok_s_finished"] = stats["tok_s"]
    stats["errors"] = stats["failed"]
    print(f"  C={c} {label or kind}: {stats['tok_s']} tok/s, TTFT p50 {stats['ttft_ms_p50']} ms, "
          f"{stats['errors']} failed", file=sys.stderr)  # fmt: skip
    return stats


def http_vs_grpc(address: str, http_url: str, model: str, levels: list[int], params, args):
    """Per level and round: gRPC and HTTP (swapped each round); the ratio is the median over
    rounds of HTTP tok/s / gRPC tok/s."""
    out: dict = {
        "levels": {},
        "client_processes": args.client_processes,
        "tok_s": "completion tokens of requests finished in the window / window",
    }
    with client_pool(args.client_processes) as pool:
        for c in levels:
            rounds = []
            for r in range(args.http_rounds):
                order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
                runs = {}
                for kind in order:
                    target = address if kind == "grpc" else http_url
                    runs[kind] = level(
                        pool, args.client_processes, kind, target, model, c, params, args
                    )
                runs["http_over_grpc_tok_s"] = ratio(
                    runs["http"]["tok_s_finished"], runs["grpc"]["tok_s_finished"]
                )
                runs["http_over_grpc_ttft_p50"] = ratio(
                    runs["http"]["ttft_ms_p50"], runs["grpc"]["ttft_ms_p50"]
                )
                rounds.append(runs)
            out["levels"][str(c)] = {
                "rounds": rounds,
                "http_over_grpc_tok_s": _median([r["http_over_grpc_tok_s"] for r in rounds]),
                "http_over_grpc_ttft_p50": _median([r["http_over_grpc_ttft_p50"] for r in rounds]),
            }
    return out


def http_url_of(log: list[str]) -> str:
    for line in reversed(log):
        if m := re.search(r"HTTP API on (http://\S+/v1)", line):
            return m.group(1)
    raise RuntimeError("the coordinator did not report an HTTP API")


def _median(values):
    values = [v for v in values if v is not None]
    return round(float(np.median(values)), 3) if values else None


def plot_http(result: dict, path) -> None:
    """tok/s and TTFT p50 per level, gRPC vs HTTP (each round a point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["http_vs_grpc"]["levels"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, style in (("grpc", "o-"), ("http", "s--")):
        for key, ax in (("tok_s_finished", a), ("ttft_ms_p50", b)):
            cs, ys = [], []
            for c, data in levels.items():
                for run in data["rounds"]:
                    cs.append(int(c))
                    ys.append(np.nan if run[kind][key] is None else run[kind][key])
            ax.plot(cs, ys, style, label=kind, alpha=0.8)
    for ax, label in ((a, "aggregate output tok/s"), (b, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"HTTP (openai package) vs gRPC: {result['model']}, {result['device']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
