"""`wedlm-coordinator local`: a whole cluster on this machine. Worker processes start on
127.0.0.1 and advertise over Bonjour on loopback; the coordinator finds them there, plans
their layers, answers the prompt (if one is given) and stops everything afterwards."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.env_switches import SECRET
from common.errors import WedlmError
from common.tls import load_tls
from coordinator.engine.local_engine import resolve_model
from coordinator.service.progress_lines import PROGRESS_EVERY_S, still_working
from coordinator.service.serve_args import serve_options
from coordinator.service.server import CoordinatorServer
from wedlm_client.cli import params_from_args
from wedlm_client.client import WedlmClient

START_TIMEOUT_S = 600.0


def start_worker(
    model: Path, cluster: str, secret: str, log: Path, tls_flags: list[str]
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shard_worker.cli", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--cluster", cluster, *tls_flags]
    env = {**os.environ, SECRET.name: secret}  # not on the command line, where ps shows it
    with open(log, "w") as err:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)


def _await_listening(proc: subprocess.Popen, log: Path) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise WedlmError(f"a worker failed to start: {tail[0]} (log: {log})")
    # Keep draining so a chatty worker never blocks on a full pipe.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return line.strip()


def run_local(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    cluster = f"local-{secrets.token_hex(4)}"  # never join or take workers of another cluster
    secret = args.secret or secrets.token_hex(16)
    logs = Path(tempfile.mkdtemp(prefix="wedlm-local-"))
    load_tls(args.tls_cert, args.tls_key, args.tls_ca)  # checked before starting workers
    tls_flags = [
        f"--{flag}={value}"
        for flag, value in (
            ("tls-cert", args.tls_cert),
            ("tls-key", args.tls_key),
            ("tls-ca", args.tls_ca),
        )
        if value
    ]
    procs = [
        start_worker(model, cluster, secret, logs / f"worker-{i}.log", tls_flags)
        for i in range(args.workers)
    ]
    say(f"started {args.workers} worker processes on 127.0.0.1 (their logs: {logs})")
    server = None
    try:
        opts = serve_options(
            args,
            model=model,
            host="127.0.0.1",
            cluster=cluster,
            secret=secret,
            expect=args.workers,
            # A local cluster's name is new each run: keep jobs only where asked to.
            state_dir=args.state_dir if str(args.state_dir or "none") != "none" else None,
        )
        # the coordinator loads its parts while the workers start (each its own process)
        with still_working(say, "loading the model's embedding, head and tokenizer"):
            server = CoordinatorServer(opts)
        with still_working(say, "waiting for the workers to start"):
            for i, proc in enumerate(procs):
                say(_await_listening(proc, logs / f"worker-{i}.log"))
        server.start()
        _await_ready(server)
        if server.failed or not server.ready.is_set():
            raise WedlmError(server.failed or _not_ready(server))
        address = f"127.0.0.1:{server.port}"
        print(
            f"local cluster {cluster} at {address}: {server.layout()}", file=sys.stderr, flush=True
        )
        if server.http is not None:
            url = f"http://127.0.0.1:{server.http.port}/v1"
            say(f"OpenAI-compatible HTTP API on {url}")
            console = f"http://127.0.0.1:{server.http.port}/"
            say(f"web console on {console}")
        if args.prompt or args.prompt_ids:
            _answer(address, args)
        if args.keep_running:
            print(f"serving on {address}; Ctrl-C stops", file=sys.stderr, flush=True)
            threading.Event().wait()
        return 0
    finally:
        if server is not None:
            server.stop(1.0)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _await_ready(server: CoordinatorServer) -> None:
    """Wait for readiness, saying what the coordinator is doing every few seconds."""
    started = said = time.monotonic()
    while not server.ready.wait(1.0):
        now = time.monotonic()
        if now - started > START_TIMEOUT_S:
            return
        if now - said >= PROGRESS_EVERY_S:
            said = now
            say(f"{server.doing()} ({now - started:.0f} s)")


def _answer(address: str, args: argparse.Namespace) -> None:
    params = params_from_args(args)
    ids = list(args.prompt_ids) if args.prompt_ids else None
    tls = load_tls(args.tls_cert, args.tls_key, args.tls_ca)
    with WedlmClient(address, tls=tls, api_key=args.api_key) as client:
        events = client.generate_stream(args.prompt, ids, args.chat, params)
        with still_working(say, "reading the prompt"):  # its prefill comes before any token
            first = next(events, None)
        final = {}
        for event in itertools.chain([first] if first is not None else [], events):
            if event[0] == "tokens" and not args.json and event[2]:
                sys.stdout.write(event[2])
                sys.stdout.flush()
            elif event[0] == "final":
                final = event[1]
    print(json.dumps(final) if args.json else "", flush=True)


def _not_ready(server: CoordinatorServer) -> str:
    """Why the local cluster did not come up in START_TIMEOUT_S, by the state it was in."""
    state, detail = server.state, f": {server.waiting}" if server.waiting else ""
    why = {
        "waiting-for-workers": f"the workers were not found{detail}",
        "planning": f"the layers were not assigned{detail}",
        "warming-up": "the warm-up (running each first forward shape once) did not finish",
        "measuring": "measuring what a forward of several rows costs did not finish",
    }.get(state, f"the coordinator was {state}")
    return f"not ready after {START_TIMEOUT_S:g} s: {why}"
