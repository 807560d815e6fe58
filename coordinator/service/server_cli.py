"""`wedlm-coordinator`: `serve` runs the coordinator of a cluster; `local` starts a whole
cluster on this machine (workers + coordinator on 127.0.0.1, found over Bonjour on
loopback) and answers one prompt."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence as Seq
from pathlib import Path

from common.api_key_env import API_KEY_ENV
from common.errors import WedlmError
from common.kv_format import KV_BITS, KV_GROUP_SIZES
from common.layer_range import LayerRange
from common.server_install import require_server_install
from coordinator.engine.limits import knobs
from coordinator.service.request_limits import BYTES_PER_TOKEN, MIN_REQUEST_BYTES
from coordinator.service.serve_args import serve_options, state_dir

__all__ = ["apply_config", "build_parser", "main", "serve_options"]

SIGNAL_POLL_S = 0.05  # how soon SIGTERM/SIGINT starts the drain


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def _number(kind: type, low: float, what: str):
    """An argparse type: a `kind` number of at least `low` (finite)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text}")
        return value

    return parse


_positive = _number(int, 1, "a positive integer")
_non_negative = _number(int, 0, "a whole number")
_seconds = _number(float, 1e-3, "seconds")


def _origins(text: str) -> list[str]:
    origins = [o.strip() for o in text.split(",") if o.strip()]
    if not origins:
        raise argparse.ArgumentTypeError("expected origins such as https://host,http://host:3000")
    return origins


def _layer_range(text: str):
    try:
        layers = LayerRange.parse(text)
    except WedlmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if layers.start != 0:
        raise argparse.ArgumentTypeError(
            f"the coordinator's layers come right after the embedding: {text} must start at 0"
        )
    return layers


def add_serve_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=model_required,
        help="model folder, 'default', or a Hugging Face hub id (org/name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=50051, help="port (0 = any free port)")
    p.add_argument("--cluster", default="default", help="cluster name (workers must match)")
    p.add_argument("--secret", default=os.environ.get("WEDLM_SECRET"), help="cluster secret")
    p.add_argument(
        "--max-running",
        type=_positive,
        default=None,
        help="sequences decoded at once (default: as many typical requests as the measured "
        "free memory holds, up to 64; the startup log and `wedlm status` say why)",
    )
    for f, knob in knobs():  # the scheduler's settings (coordinator/engine/limits.py)
        parse = _positive if knob.low == 1 else _number(int, knob.low, "a whole number")
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=parse, default=f.default, help=knob.help)
    p.add_argument(
        "--micro-batches",
        type=_positive,
        default=None,
        help="micro-batches in flight (default: one per worker)",
    )
    p.add_argument(
        "--tp",
        type=_positive,
        default=1,
        metavar="N",
        help="tensor parallelism: workers form groups of N that each hold one stage's layers "
        "split N ways over mlx.distributed (ring, or nccl on CUDA), so one answer runs on N "
        "machines at once; what cannot be grouped (heads that do not divide, a model "
        "without mlx-lm's Model.shard, a worker started with --layers) stays a pipeline "
        "stage, as `wedlm status` says (default: 1, a pipeline only)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus metrics on this HTTP port (0: any free port)",
    )
    p.add_argument(
        "--http-port",
        type=_port,
        help="also serve the OpenAI-compatible HTTP API on this port (0 = any free port)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="clients must send 'Authorization: Bearer KEY' (HTTP and gRPC; "
        "default: $WEDLM_API_KEY)",
    )
    p.add_argument("--served-model-name", help="the model's name in the APIs (default: folder)")
    p.add_argument(
        "--cors-origins",
        type=_origins,
        default=None,
        metavar="ORIGIN,...",
        help="browser origins the HTTP API answers cross-origin requests from (CORS), "
        "comma-separated, e.g. https://chat.example.com ('*': any); default: none",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        help="store keys and values quantized to this many bits on every stage (default: "
        "the model's dtype); attention then runs through mlx-lm's quantized path",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=64,
        help="quantization group along the head dimension, with --kv-bits",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=_positive,
        help="KV rows of finished requests kept for reuse by later prompts that start the "
        "same way (default: half of the KV the stages' free memory holds)",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt from scratch (no reuse of earlier requests' KV)",
    )
    p.add_argument(
        "--draft-model",
        help="a small model with the served model's tokenizer, run on the coordinator to "
        "draft tokens for speculative requests (draft 'model'; 'auto' then prefers it)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=_positive,
        default=2048,
        help="max tokens of an HTTP request that names no limit (capped by the context)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_number(int, MIN_REQUEST_BYTES, "a number of bytes"),
        default=None,
        help="the largest HTTP request body and gRPC client message; larger ones are refused "
        "(413, RESOURCE_EXHAUSTED) before they are read (default: the model's context "
        f"times {BYTES_PER_TOKEN} bytes, plus 1 MiB)",
    )
    p.add_argument("--kv-reserve-tokens", type=_positive, default=32768)
    p.add_argument(
        "--keep-finished",
        type=_positive,
        default=10_000,
        help="finished jobs kept for GetJob/WaitJob (the oldest are forgotten beyond it)",
    )
    p.add_argument(
        "--wait-for-workers",
        "--wait-timeout",
        dest="wait_timeout",
        type=_seconds,
        default=600.0,
        help="seconds to wait for the layers to be covered before giving up with a message "
        "naming what is missing (workers that come later are taken in at any time)",
    )
    p.add_argument(
        "--layers",
        type=_layer_range,
        default=None,
        help="the coordinator holds exactly layers A-B itself (A must be 0: its layers come "
        "right after the embedding); default: a share of the model planned by memory",
    )
    p.add_argument(
        "--warm-up",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the first forward shapes once before readiness, so that the first requests "
        "do not wait for kernel compilation (auto: on GPUs; MLX's CPU backend compiles "
        "nothing per shape)",
    )
    p.add_argument(
        "--no-local-layers",
        action="store_true",
        help="hold no layers in the coordinator (a small machine): workers hold them all",
    )
    p.add_argument(
        "--tls-cert",
        help="PEM certificate: serve clients over TLS, and present "
        "it to workers that require client certificates",
    )
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA that workers' certificates must chain to")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="keep accepted jobs and results here (SQLite), so a restart loses none "
        "(default: the user state folder; 'none' keeps nothing)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wedlm-coordinator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the coordinator of a cluster")
    serve.add_argument("--config", help="a TOML file of settings (deploy/cluster.example.toml)")
    add_serve_flags(serve, model_required=False)
    serve.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a worker to use besides those found over Bonjour (repeatable)",
    )
    serve.add_argument(
        "--expect",
        type=_non_negative,
        default=0,
        help="wait for N workers before the first plan (default 0: serve as soon as the "
        "layers are covered, taking later workers in by re-planning)",
    )
    serve.add_argument("--no-bonjour", action="store_true", help="use only --worker")
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds accepted jobs may take to finish",
    )
    serve.set_defaults(subparser=serve)
    add_generate_command(sub)
    local = sub.add_parser("local", help="start a local cluster and answer one prompt")
    local.add_argument("--workers", type=_positive, default=2)
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
    """Settings from --config fill in whatever the command line left at its default."""
    if args.config:
        from coordinator.service.serve_config import load_serve_config

        for key, value in load_serve_config(args.config).items():
            if key == "bonjour":
                args.no_bonjour = args.no_bonjour or not value
            elif key == "workers":
                args.worker = args.worker or value
            elif key == "local_layers":
                args.no_local_layers = args.no_local_layers or not value
            elif key == "prefix_cache":
                args.no_prefix_cache = args.no_prefix_cache or not value
            elif key == "layers":
                args.layers = args.layers or LayerRange.parse(value)
            elif getattr(args, key) == parser.get_default(key) or getattr(args, key) is None:
                setattr(args, key, Path(value) if key == "state_dir" else value)
    if not args.model:
        raise WedlmError("--model is required (on the command line or in --config)")


def serve(args: argparse.Namespace) -> int:
    from coordinator.engine.local_engine import resolve_model
    from coordinator.model_source.hub_model import looks_like_repo_id
    from coordinator.service.server import CoordinatorServer

    if looks_like_repo_id(args.model) and not args.served_model_name:
        args.served_model_name = args.model  # the hub id, not the snapshot's folder name
    opts = serve_options(
        args,
        model=resolve_model(args.model),
        workers=args.worker,
        expect=args.expect,
        bonjour=not args.no_bonjour,
        state_dir=state_dir(args.state_dir),
    )
    server = CoordinatorServer(opts)
    server.start()
    print(f"wedlm-coordinator listening on {args.host}:{server.port}", flush=True)
    if server.http is not None:
        print(f"wedlm-coordinator HTTP API on http://{args.host}:{server.http.port}/v1", flush=True)
    if server.metrics_port is not None:
        print(
            f"wedlm-coordinator metrics on http://{args.host}:{server.metrics_port}/metrics",
            flush=True,
        )
    # The handlers only append (no lock): an Event's set() would take the lock of the
    # Event.wait that the signal interrupts on this same thread, and hang for good.
    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: signalled.append(signum))
    server.ready.wait()
    if server.failed:
        server.stop(0)
        raise WedlmError(server.failed)
    print(f"wedlm-coordinator serving {server.model_name}: {server.layout()}", flush=True)
    while not signalled:
        time.sleep(SIGNAL_POLL_S)
    cancelled = server.drain(args.drain_timeout)
    print(f"wedlm-coordinator drained ({cancelled} unfinished jobs cancelled)", flush=True)
    server.stop()
    return 0


def add_generate_command(sub) -> None:
    """`generate`: one prompt on a single-process engine on this machine (what
    `wedlm generate --model` runs), with `wedlm generate`'s flags."""
    from wedlm_client.cli import add_generation_flags, add_tls_flags

    gen = sub.add_parser("generate", help="generate a completion for one prompt on this machine")
    gen.add_argument("--model", required=True, help="a model folder, or 'default'")
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
        from coordinator.service.local_cluster import run_local

        return run_local(args)
    except WedlmError as e:
        print(f"wedlm-coordinator: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
