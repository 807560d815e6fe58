"""`wedlm-worker`: serve a contiguous range of a model's layers to a coordinator.

    wedlm-worker [--model PATH|default] [--layers A-B] [--host H] [--port N] [--cluster NAME]
                 [--secret S | env WEDLM_SECRET] [--node-id ID] [--no-bonjour]
                 [--advertise-host IP] [--cache-dir DIR] [--cache-max-gb G]
    wedlm-worker --clear-cache [--cache-dir DIR]

Without --model the worker takes the coordinator's model: it fetches the layers it is
assigned from the coordinator into its cache folder and loads them from there.

Once serving it prints one line to stdout (scripts and tests read the port from it):
    wedlm-worker <node_id> listening on HOST:PORT layers A-B (model <identity>)
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

from common.env_switches import SECRET
from common.stop_signals import StopRequested, StopSignals

PROG = "wedlm-worker"
SIGNAL_POLL_S = 0.1  # how soon SIGTERM/SIGINT starts the shutdown
STOP_WAIT_S = 3.0  # for the MLX thread's work in progress (loading layers), at stop
EXIT_WAIT_S = 3.0  # for the interpreter's own exit, after a stop (see _exit_watchdog)
log = logging.getLogger(PROG)


def _exit_watchdog(code: int) -> int:
    """Returns `code`, having armed a daemon thread that ends the process with it if the
    interpreter's exit takes longer than EXIT_WAIT_S: that exit joins the gRPC handlers'
    threads, and one may still be fetching layers (its call was cancelled, its fetch goes
    on until its layer file is whole)."""

    def leave() -> None:
        time.sleep(EXIT_WAIT_S)
        _leave_now(code)

    threading.Thread(target=leave, name="exit-watchdog", daemon=True).start()
    return code


def _leave_now(code: int) -> None:
    """Exit without the interpreter's shutdown: the MLX thread is still busy (loading
    layers), and its per-thread state would abort the process as the interpreter
    finalizes (common/mlx_thread_exit.py). A worker keeps nothing a stop could lose (a
    fetch resumes from its .part files)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _layer_range(text: str):
    from common.errors import WedlmError
    from common.layer_range import LayerRange

    try:
        return LayerRange.parse(text)
    except WedlmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: expected 0-65535")
    return int(text)


def _ip(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address") from None


def _node_id(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}", text):
        raise argparse.ArgumentTypeError(
            f"invalid node id {text!r}: use letters, digits and '-' (at most 63)"
        )
    return text


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Serve a range of a model's layers.")
    p.add_argument(
        "--model",
        help="checkpoint folder, or 'default'; without it the worker fetches the layers it "
        "is assigned from the coordinator",
    )
    p.add_argument(
        "--layers",
        type=_layer_range,
        help="hold exactly layers A-B (inclusive); without it the coordinator assigns a range",
    )
    p.add_argument("--host", type=_non_empty, default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=_port, default=0, help="port to bind (0: pick a free one)")
    p.add_argument("--cluster", type=_non_empty, default="default", help="cluster name")
    p.add_argument("--secret", help="cluster secret (prefer the WEDLM_SECRET variable)")
    p.add_argument("--node-id", type=_node_id, help="name of this worker (default host-port)")
    p.add_argument("--no-bonjour", action="store_true", help="do not advertise over mDNS")
    p.add_argument("--advertise-host", type=_ip, help="address to advertise to peers")
    p.add_argument("--tls-cert", help="PEM certificate: serve over TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA: accept only coordinators with a certificate it signed")
    p.add_argument(
        "--cache-dir",
        help="where fetched layers are kept (default: the wedlm-cluster cache folder's 'layers')",
    )
    p.add_argument(
        "--cache-max-gb",
        type=_positive_gb,
        help="cap on the layer cache; without it only the model in use is kept",
    )
    p.add_argument(
        "--fetch-limit-mbps",
        type=_positive_mbps,
        help="fetch layers at most this fast (megabits per second), to leave the network room",
    )
    p.add_argument(
        "--clear-cache", action="store_true", help="delete every fetched layer, then exit"
    )
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING"])
    return p


def _positive(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive {unit}")
    return value


def _positive_gb(text: str) -> float:
    return _positive(text, "number of GB")


def _positive_mbps(text: str) -> float:
    return _positive(text, "number of megabits per second")


def _layer_cache(args):
    from common.default_model import default_cache_dir
    from shard_worker.layer_cache import LayerCache

    root = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir() / "layers"
    cap = int(args.cache_max_gb * 1e9) if args.cache_max_gb else None
    return LayerCache(root, cap)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from common.server_install import require_server_install

    require_server_install(PROG)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format=f"{PROG}: %(levelname)s %(message)s"
    )
    if args.clear_cache:
        cache = _layer_cache(args)
        freed = cache.clear()
        print(f"{PROG}: removed {freed / 1e6:.1f} MB of fetched layers from {cache.root}")
        return 0
    secret = args.secret or SECRET.read() or None
    signals = StopSignals()
    try:
        worker = _build_worker(args, secret)
        signals.raising = False
    except StopRequested:
        print(f"{PROG}: stopped while loading", file=sys.stderr, flush=True)
        _leave_now(0)  # the MLX thread may still be loading layers
    if isinstance(worker, int):  # a bad flag or model: said already
        return worker
    worker.start()
    layers = str(args.layers) if args.layers else "unassigned"
    config = worker.options.config
    print(
        f"{PROG} {worker.node_id} listening on {args.host}:{worker.port} layers {layers} "
        f"(model {config.identity if config else 'from the coordinator'})",
        flush=True,
    )
    while not signals.received:
        time.sleep(SIGNAL_POLL_S)
    if not worker.stop(grace=2.0, wait_s=STOP_WAIT_S):
        _leave_now(0)
    return _exit_watchdog(0)


def _build_worker(args: argparse.Namespace, secret: str | None):
    """The WorkerServer the flags describe, or the exit code of an error (said)."""
    # Imported here so that --help and flag errors answer without loading MLX.
    from common.default_model import default_model_path
    from common.errors import WedlmError
    from common.model_config import load_model_config
    from common.tls import load_tls
    from shard_worker.bonjour import is_loopback
    from shard_worker.server import WorkerOptions, WorkerServer

    try:
        config, cache = None, None
        if args.model is not None and (
            args.cache_dir or args.cache_max_gb or args.fetch_limit_mbps
        ):
            return _fail(
                "--cache-dir, --cache-max-gb and --fetch-limit-mbps are for workers without --model"
            )
        if args.model is None:
            cache = _layer_cache(args)
        else:
            path = default_model_path() if args.model == "default" else Path(args.model)
            config = load_model_config(path)
        if config is not None and args.layers is not None and args.layers.end >= config.num_layers:
            return _fail(
                f"--layers {args.layers} is past the model's {config.num_layers} layers "
                f"(0-{config.num_layers - 1})"
            )
        options = WorkerOptions(
            config=config,
            layers=args.layers,
            host=args.host,
            port=args.port,
            cluster=args.cluster,
            secret=secret,
            node_id=args.node_id,
            bonjour=not args.no_bonjour,
            advertise_host=args.advertise_host,
            tls=load_tls(args.tls_cert, args.tls_key, args.tls_ca),
            cache=cache,
            fetch_limit=args.fetch_limit_mbps * 1e6 / 8 if args.fetch_limit_mbps else None,
        )
        worker = WorkerServer(options)
    except (WedlmError, OSError, RuntimeError) as e:
        return _fail(str(e))
    if secret is None and not is_loopback(args.host):
        log.warning("no cluster secret: anyone who can reach this port can use the worker")
    return worker


if __name__ == "__main__":
    sys.exit(main())
