"""ServeOptions from the parsed flags that `serve` and `local` share (server_cli.py,
local_cluster.py both use it; it imports neither)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.kv_format import KVFormat
from coordinator.engine.limits import Limits, knobs


def state_dir(flag: Path | None) -> Path | None:
    if flag is not None:
        return None if str(flag) == "none" else flag
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "wedlm-cluster"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "wedlm-cluster"


def serve_options(args: argparse.Namespace, **fixed):
    """ServeOptions from the flags `serve` and `local` share, plus `fixed` ones."""
    from common.tls import load_tls
    from coordinator.engine.local_engine import resolve_model
    from coordinator.service.server import ServeOptions

    shared = dict(
        host=args.host,
        port=args.port,
        cluster=args.cluster,
        secret=args.secret,
        max_running=args.max_running,
        limits=Limits(**{f.name: getattr(args, f.name) for f, _ in knobs()}),
        micro_batches=args.micro_batches or 0,
        tp=args.tp,
        metrics_port=args.metrics_port,
        wait_timeout_s=args.wait_timeout,
        kv_reserve_tokens=args.kv_reserve_tokens,
        keep_finished=args.keep_finished,
        local_layers=args.local_layers,
        warm_up=args.warm_up,
        layers=args.layers,
        tls=load_tls(args.tls_cert, args.tls_key, args.tls_ca),
        http_port=args.http_port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name,
        draft_model=resolve_model(args.draft_model) if args.draft_model else None,
        kv=KVFormat(args.kv_bits, args.kv_group_size),
        prefix_cache=args.prefix_cache,
        prefix_cache_tokens=args.prefix_cache_tokens,
        default_max_tokens=args.default_max_tokens,
        max_request_bytes=args.max_request_bytes,
        cors_origins=tuple(args.cors_origins or ()),
    )
    return ServeOptions(**{**shared, **fixed})
