"""The `wedlm bench` subcommands' flags. Each prints a table (or, with --json, one JSON
object) on stdout, writes JSON and a PNG to --out, and shows its progress on stderr."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from common.env_switches import SECRET
from common.generation_params import MODES


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


def _non_negative(text: str) -> float:
    value = _positive(float)(text) if text.strip() not in ("0", "0.0") else 0.0
    return value


def _common(p: argparse.ArgumentParser, stem: str) -> None:
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help=f"folder for {stem}.json and {stem}.png (default: ./bench-results)",
    )
    p.add_argument("--json", action="store_true",
                   help="print the JSON object on stdout instead of the table")  # fmt: skip
    p.set_defaults(bench_run=stem)


def _cluster(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster", metavar="HOST:PORT", required=True, help="the coordinator's gRPC address"
    )


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure a cluster (or any OpenAI-compatible server)",
                           description=__doc__)  # fmt: skip
    cmds = bench.add_subparsers(dest="bench_command", required=True)

    serve = cmds.add_parser(
        "serve",
        help="closed-loop serving: tok/s, TTFT and TPOT against C",
        description="A closed loop of C streaming clients per target and "
        "level; two targets are compared round by round (ABAB).",
    )
    serve.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="[NAME=]URL",
        help="http(s)://HOST:PORT[/v1] (any OpenAI-compatible API) or "
        "[grpc://]HOST:PORT (a coordinator); repeat to compare",
    )
    serve.add_argument("--concurrency", type=_positive(int), nargs="+", default=[1, 8, 32])
    serve.add_argument(
        "--duration", type=_positive(float), default=15.0, help="measured seconds per run"
    )
    serve.add_argument(
        "--warmup",
        type=_non_negative,
        default=5.0,
        help="unmeasured seconds per run (with --requests: 0 for none)",
    )
    serve.add_argument(
        "--requests",
        type=_positive(int),
        default=0,
        help="measured requests per run instead of --duration",
    )
    serve.add_argument("--rounds", type=_positive(int), default=2, help="rounds per level")
    serve.add_argument("--max-tokens", type=_positive(int), default=128)
    serve.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="decoding mode (gRPC; for HTTP sent as an extra field unless auto)",
    )
    serve.add_argument(
        "--model", help="HTTP targets: the model name (default: the first of GET /v1/models)"
    )
    serve.add_argument(
        "--label-cluster",
        metavar="HOST:PORT",
        help="label HTTP results with this coordinator's cluster status",
    )
    serve.add_argument(
        "--client-processes",
        type=_positive(int),
        default=min(4, os.cpu_count() or 1),
        help="processes the clients are spread over",
    )
    _common(serve, "serve")

    lat = cmds.add_parser("latency", help="single stream per mode: TTFT, per-token time, "
                          "tokens per forward")  # fmt: skip
    _cluster(lat)
    lat.add_argument("--modes", nargs="+", choices=MODES, default=["ar", "wedlm", "speculative"])
    lat.add_argument("--requests", type=_positive(int), default=5, help="measured, per mode")
    lat.add_argument("--warmup", type=int, default=1, help="unmeasured requests per mode")
    lat.add_argument("--max-tokens", type=_positive(int), default=128)
    _common(lat, "latency")

    links = cmds.add_parser("links", help="the round trip and compute of each stage's link, "
                            "as the coordinator measures them")  # fmt: skip
    _cluster(links)
    links.add_argument(
        "--requests",
        type=int,
        default=4,
        help="AR requests sent first so that the cluster has forwarded (0: none)",
    )
    links.add_argument("--max-tokens", type=_positive(int), default=32)
    _common(links, "links")

    agent = cmds.add_parser(
        "agent",
        help="an agent session replayed turn by turn: TTFT, cached tokens, decode tok/s",
        description="A synthetic, seeded agent session (a system prompt and tools, then "
        "turns of a user message, a tool call and a tool result) sent turn by turn, each "
        "turn the whole conversation so far, streamed. A repeated run with the same --seed "
        "finds its first turn cached; a new seed starts cold.",
    )
    agent.add_argument("--url", required=True, metavar="URL",
                       help="http(s)://HOST:PORT[/v1] of an OpenAI-compatible or Anthropic "
                       "API")  # fmt: skip
    agent.add_argument("--api", choices=("openai", "anthropic"), default="openai",
                       help="chat completions with tools, or Anthropic Messages")  # fmt: skip
    agent.add_argument("--model", help="the model name (default: the first the server lists)")
    agent.add_argument("--api-key", help="default: $OPENAI_API_KEY or $ANTHROPIC_API_KEY")
    agent.add_argument("--system-tokens", type=_positive(int), default=20000,
                       help="the system prompt and tool definitions, in tokens")  # fmt: skip
    agent.add_argument("--turns", type=_positive(int), default=20)
    agent.add_argument("--tool-result-tokens", type=_positive(int), nargs=2,
                       default=[1000, 3000], metavar=("MIN", "MAX"),
                       help="each tool result's length, seeded")  # fmt: skip
    agent.add_argument("--budget-tokens", type=_positive(int), default=64000,
                       help="no turn takes the session past this many tokens")  # fmt: skip
    agent.add_argument("--max-tokens", type=_positive(int), default=32, help="per turn")
    agent.add_argument("--seed", type=int, default=0, help="the session's text")
    _common(agent, "agent")

    fetch = cmds.add_parser("fetch", help="layer-fetch rate from a coordinator against a raw "
                            "copy (needs the server install)")  # fmt: skip
    _cluster(fetch)
    fetch.add_argument(
        "--secret",
        default=SECRET.read(),
        help="the cluster secret (default: $WEDLM_SECRET)",
    )
    fetch.add_argument("--layers", help="A-B (default: every layer)")
    fetch.add_argument(
        "--copy-from",
        type=Path,
        help="a local copy of the checkpoint: its weight files are copied too",
    )
    fetch.add_argument("--repeats", type=_positive(int), default=3)
    fetch.add_argument("--scratch", type=Path, help="where caches go (default: the temp dir)")
    _common(fetch, "fetch")


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    import importlib

    if args.bench_run == "fetch":
        return fetch_on_this_machine(argv)
    module = importlib.import_module(f"wedlm_client.bench.{args.bench_run}")
    module.run(args)
    return 0


def fetch_on_this_machine(argv: list[str]) -> int:
    """`bench fetch` runs the worker's own layer fetcher: the server install does it, in a
    process of its own (shard_worker/fetch_bench.py), with the same arguments."""
    import importlib.util
    import subprocess
    import sys

    from common.errors import WedlmError

    missing = [m for m in ("mlx", "shard_worker") if importlib.util.find_spec(m) is None]
    if missing:  # the client-only install
        raise WedlmError(
            f"bench fetch needs the server install ({missing[0]} is missing): "
            "pip install 'wedlm-cluster[server,bench]'"
        )
    return subprocess.call([sys.executable, "-m", "shard_worker.fetch_bench", *argv])
