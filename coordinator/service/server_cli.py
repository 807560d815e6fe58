"""`wedlm-coordinator`: `serve` runs the coordinator of a cluster; `local` starts a whole
cluster on this machine (workers + coordinator on 127.0.0.1, found over Bonjour on
loopback) and answers one prompt."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence as Seq

from common.errors import WedlmError
from common.server_install import require_server_install
from common.stop_signals import StopRequested, StopSignals
from coordinator.knobs import Knob, default_of, kind_of
from coordinator.service.progress_lines import PROGRESS_EVERY_S, still_working
from coordinator.service.serve_args import serve_options
from coordinator.service.serve_config import serve_knobs

__all__ = ["apply_config", "build_parser", "main", "serve_options"]

SIGNAL_POLL_S = 0.05  # how soon SIGTERM/SIGINT starts the drain
STARTING_STOP_S = 3.0  # a stop while starting waits this long for the planner's thread
DEATH_LINGER_S = 10.0  # after the engine died: health and clients say why, then exit 1


def leave_now(code: int) -> None:
    """Exit without the interpreter's shutdown: a thread still runs MLX (the warm-up, say),
    whose per-thread state would abort the process as the interpreter finalizes (see
    release_mlx_thread). Nothing is lost: accepted jobs are committed when accepted."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _number(kind: type, k: Knob):
    """An argparse type: a `kind` number within the Knob's bounds (finite)."""
    low = k.low if k.low is not None else float("-inf")
    what = k.expect or (
        "a number" if kind is float else "a positive integer" if low >= 1 else "a whole number"
    )

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if k.high is not None and not low <= value <= k.high:
            bounds = f"must be in [{k.low:g}, {k.high:g}], got {value}"
            raise argparse.ArgumentTypeError(f"{k.noun} {bounds}" if k.noun else bounds)
        if value < low or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text}")
        return value

    return parse


def _parsed(parse):
    """An argparse type from a Knob's parse (its ValueError: the flag's message)."""

    def run(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    run.__name__ = parse.__name__
    return run


def add_serve_flags(
    p: argparse.ArgumentParser, model_required: bool = True, serve: bool = False
) -> None:
    """The flags of every setting (ServeSettings, Limits); `serve`: also serve's own."""
    for cls, f, k in serve_knobs():
        if k.serve_only and not serve:
            continue
        kind = kind_of(cls, f.name)
        default = default_of(f)
        options: dict = {"dest": f.name, "help": k.help}
        if kind is bool:
            flags = k.flags or (f"--{'no-' if default else ''}{f.name.replace('_', '-')}",)
            p.add_argument(*flags, action="store_false" if default else "store_true", **options)
            continue
        if k.env is not None and (value := k.env.read()) is not None:
            default = value
        options["default"] = default
        if k.metavar:
            options["metavar"] = k.metavar
        if k.choices:
            options.update(type=kind, choices=k.choices)
        elif k.parse is not None:
            options["type"] = _parsed(k.parse)
        elif kind is list:
            options["action"] = "append"
        elif kind in (int, float):
            options["type"] = _number(kind, k)
        if f.name == "model":
            options["required"] = model_required
        p.add_argument(*(k.flags or ("--" + f.name.replace("_", "-"),)), **options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wedlm-coordinator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the coordinator of a cluster")
    serve.add_argument("--config", help="a TOML file of settings (deploy/cluster.example.toml)")
    add_serve_flags(serve, model_required=False, serve=True)
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds accepted jobs may take to finish",
    )
    serve.set_defaults(subparser=serve)
    add_generate_command(sub)
    local = sub.add_parser("local", help="start a local cluster and answer one prompt")
    local.add_argument("--workers", type=_number(int, Knob(None)), default=2)
    local.add_argument(
        "--keep-running",
        action="store_true",
        help="keep serving after the prompt (Ctrl-C stops everything)",
    )
    from wedlm_client.cli import add_generation_flags

    add_serve_flags(local)
    local.set_defaults(port=0)
    add_generation_flags(local, prompt_required=False)
    return parser


def apply_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Settings from --config fill in whatever the command line left at its default (a
    setting's flag and key name the same field)."""
    if args.config:
        from coordinator.service.serve_config import load_serve_config

        for name, value in load_serve_config(args.config).items():
            if getattr(args, name) in (parser.get_default(name), None):
                setattr(args, name, value)
    if not args.model:
        raise WedlmError("--model is required (on the command line or in --config)")


def serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (exit 0: drained when serving, at once while starting)
    or until the engine cannot go on (exit 1)."""
    signals = StopSignals()
    server = None
    what = f"wedlm-coordinator: loading {args.model} (tokenizer, embedding, head)"
    print(what, flush=True)
    try:
        with still_working(lambda text: print(text, flush=True), what):
            server = _build_server(args)
        signals.raising = False
    except StopRequested:
        signals.raising = False
        print(f"wedlm-coordinator stopped while loading the model ({signals.name()})", flush=True)
        if server is not None and not server.stop(0, STARTING_STOP_S):
            leave_now(0)
        return 0
    server.start()
    print(f"wedlm-coordinator listening on {args.host}:{server.port}", flush=True)
    if server.http is not None:
        print(f"wedlm-coordinator HTTP API on http://{args.host}:{server.http.port}/v1", flush=True)
        print(f"wedlm-coordinator console on http://{args.host}:{server.http.port}/", flush=True)
    if server.metrics_port is not None:
        print(
            f"wedlm-coordinator metrics on http://{args.host}:{server.metrics_port}/metrics",
            flush=True,
        )
    started = said = time.monotonic()
    while not server.ready.wait(SIGNAL_POLL_S) and not signals.received:
        if (now := time.monotonic()) - said >= PROGRESS_EVERY_S:  # never a silent minute
            said = now
            print(f"wedlm-coordinator: {server.doing()} ({now - started:.0f} s)", flush=True)
    if signals.received and (not server.ready.is_set() or server.failed):
        return _stop_starting(server, signals)
    if server.failed:
        server.stop(0)
        raise WedlmError(server.failed)
    print(f"wedlm-coordinator serving {server.model_name}: {server.layout()}", flush=True)
    while not signals.received and server.alive():
        time.sleep(SIGNAL_POLL_S)
    if not server.alive():
        return _engine_died(server, signals)
    cancelled = server.drain(args.drain_timeout)
    print(f"wedlm-coordinator drained ({cancelled} unfinished jobs cancelled)", flush=True)
    if not server.stop():  # a thread still runs (said in the log): leave without it
        leave_now(0)
    return 0


def _stop_starting(server, signals: StopSignals) -> int:
    """A stop before serving: nothing was accepted yet, nothing to drain."""
    print(f"wedlm-coordinator stopping while {server.state} ({signals.name()})", flush=True)
    if not server.stop(0, STARTING_STOP_S):
        print("wedlm-coordinator stopped (without waiting for the planner's thread)", flush=True)
        leave_now(0)
    print("wedlm-coordinator stopped", flush=True)
    return 0


def _engine_died(server, signals: StopSignals) -> int:
    """The engine thread ended for good: every open request has failed. Readiness and
    liveness say so for a few seconds (probes and clients see why), then the process
    exits non-zero for its supervisor to start it again."""
    print(
        f"wedlm-coordinator: error: {server.loop.dead}: the engine cannot go on; exiting in "
        f"{DEATH_LINGER_S:g} s",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + DEATH_LINGER_S
    while not signals.received and time.monotonic() < deadline:
        time.sleep(SIGNAL_POLL_S)
    if not server.stop(0, STARTING_STOP_S):
        leave_now(1)
    return 1


def _build_server(args: argparse.Namespace):
    from coordinator.model_source.hub_model import looks_like_repo_id
    from coordinator.service.server import CoordinatorServer

    if looks_like_repo_id(args.model) and not args.served_model_name:
        args.served_model_name = args.model  # the hub id, not the snapshot's folder name
    return CoordinatorServer(serve_options(args))


def add_generate_command(sub) -> None:
    """`generate`: one prompt on a single-process engine on this machine (what
    `wedlm generate --model` runs), with `wedlm generate`'s flags."""
    from wedlm_client.cli import add_generation_flags, add_tls_flags

    gen = sub.add_parser("generate", help="generate a completion for one prompt on this machine")
    gen.add_argument(
        "--model",
        required=True,
        help="a model folder, a Hugging Face hub id (org/name), or 'default'",
    )
    add_generation_flags(gen)
    gen.add_argument(
        "--draft-model",
        help="a small model with the same tokenizer drafting for --mode speculative",
    )
    add_tls_flags(gen)  # accepted as `wedlm generate` accepts them; nothing is dialled


def main(argv: Seq[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "generate":  # as `wedlm generate`: warnings only
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    require_server_install(parser.prog)
    try:
        if args.command == "generate":
            from coordinator.service.local_generate import run_generate

            return run_generate(args)
        if args.command == "serve":
            apply_config(args, args.subparser)
            return serve(args)
        # the first line at once: the imports below take seconds on a small machine
        print(f"{parser.prog} local: starting {args.workers} workers and a coordinator "
              f"on this machine with model {args.model}", file=sys.stderr, flush=True)  # fmt: skip
        from coordinator.service.local_cluster import run_local

        return run_local(args)
    except WedlmError as e:
        print(f"wedlm-coordinator: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
