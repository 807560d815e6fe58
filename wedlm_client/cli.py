"""`wedlm`: the client command line. `wedlm generate` runs a prompt on a cluster's
coordinator (or locally on a model folder: `wedlm-coordinator generate` runs it, which needs
the server's install); `status` shows a cluster; `submit`, `job`, `wait` and `cancel` manage
jobs the cluster keeps; `bench` measures a cluster (wedlm_client/bench). This package never
imports the coordinator: it needs only grpcio and protobuf."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from collections.abc import Sequence as Seq

from common.errors import WedlmError
from common.generation_params import (
    DIFFUSION_SAMPLERS,
    DRAFT_SOURCES,
    MAX_DENOISING_STEPS,
    MAX_WINDOW,
    MODES,
    GenerationParams,
)


def _id_list(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids, got {text!r}"
        ) from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be non-negative, got {text!r}")
    return ids


def _threshold(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"threshold must be a positive number, got {text!r}")
    return value


def _bounded(kind, low, high=None):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < low or (high is not None and value > high) or value != value:
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text!r}")
        return value

    return parse


def add_generation_flags(p: argparse.ArgumentParser, prompt_required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=prompt_required)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_id_list, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="auto: the model's own (diffusion for a diffusion model, wedlm for a "
        "WeDLM-trained checkpoint, else ar); wedlm: "
        "parallel decoding; ar: one token per forward; speculative: drafts verified by the "
        "model (exactly AR's output, several tokens per forward when they hold); diffusion: "
        "canvases denoised over several forwards (DiffusionGemma)",
    )
    p.add_argument(
        "--sampler",
        choices=DIFFUSION_SAMPLERS,
        default="turbo",
        help="diffusion mode: turbo (top-K sampling chain, two-stage confidence, repair "
        "pass, EOS tail-drop, repeat guard) or faithful (mlx-vlm's reference sampler)",
    )
    p.add_argument(
        "--steps",
        type=_bounded(int, 0, MAX_DENOISING_STEPS),
        default=0,
        help="diffusion mode: denoising steps per canvas at most (0: the model's)",
    )
    p.add_argument(
        "--draft",
        choices=DRAFT_SOURCES,
        default="auto",
        help="speculative drafts: mask (the model's mask-slot predictions, WeDLM-trained "
        "models), lookup (n-grams of the prompt and output), model (the coordinator's "
        "--draft-model); auto picks in that order of preference: model, mask, lookup",
    )
    p.add_argument("--window", type=_bounded(int, 1, MAX_WINDOW), default=16)
    p.add_argument("--threshold", type=_threshold, default=0.4, help="entropy threshold or none")
    p.add_argument("--penalty", type=_bounded(float, 0.0), default=0.02)
    p.add_argument("--temperature", type=_bounded(float, 0.0), default=0.0)
    p.add_argument("--top-p", type=_bounded(float, 1e-9, 1.0), default=1.0)
    p.add_argument("--top-k", type=_bounded(int, 0), default=0)
    p.add_argument("--max-tokens", type=_bounded(int, 1), default=256)
    p.add_argument("--stop-ids", type=_id_list, default=())
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=_bounded(int, 0, 2**32 - 1), default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def params_from_args(args: argparse.Namespace) -> GenerationParams:
    return GenerationParams(
        mode=args.mode,
        window=args.window,
        threshold=args.threshold,
        penalty=args.penalty,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop_ids=tuple(args.stop_ids),
        stop_strings=tuple(args.stop),
        seed=args.seed,
        draft=args.draft,
        sampler=args.sampler,
        steps=args.steps,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wedlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--model",
        help="run locally on a model folder, a Hugging Face hub id (org/name), or 'default'",
    )
    where.add_argument("--cluster", metavar="HOST:PORT", help="run on a cluster's coordinator")
    add_generation_flags(gen)
    gen.add_argument(
        "--draft-model",
        help="with --model: a small model with the same tokenizer drafting for --mode speculative",
    )
    add_tls_flags(gen)
    submit = sub.add_parser("submit", help="queue a job on a cluster and print its id")
    submit.add_argument("--cluster", metavar="HOST:PORT", required=True)
    add_generation_flags(submit)
    submit.add_argument(
        "--deadline", type=_bounded(float, 0.0), default=0.0, help="seconds (0 = none)"
    )
    add_tls_flags(submit)
    for name, what in (
        ("job", "show a job's state (and its result once finished)"),
        ("wait", "wait for a job to finish and show it"),
        ("cancel", "cancel a job"),
    ):
        cmd = sub.add_parser(name, help=what)
        cmd.add_argument("job_id")
        cmd.add_argument("--cluster", metavar="HOST:PORT", required=True)
        if name == "wait":
            cmd.add_argument(
                "--timeout", type=_bounded(float, 0.0), default=0.0, help="seconds (0 = long)"
            )
        add_tls_flags(cmd)
    status = sub.add_parser("status", help="show a cluster's workers, ranges and health")
    status.add_argument("--cluster", metavar="HOST:PORT", required=True)
    status.add_argument("--json", action="store_true")
    add_tls_flags(status)
    from wedlm_client.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", help="the coordinator's API key (default: $WEDLM_API_KEY, if set)")
    p.add_argument("--tls-ca", help="PEM CA of a coordinator that serves TLS")
    p.add_argument("--tls-cert", help="PEM client certificate, if the coordinator asks for one")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")


def client_tls(args: argparse.Namespace):
    from common.tls import load_tls

    return load_tls(args.tls_cert, args.tls_key, args.tls_ca)


def open_client(args: argparse.Namespace, timeout: float = 600.0):
    from wedlm_client.client import WedlmClient

    return WedlmClient(args.cluster, timeout, tls=client_tls(args), api_key=args.api_key)


def run_generate(args: argparse.Namespace, argv: Seq[str]) -> int:
    if not args.cluster:
        return generate_on_this_machine(argv)
    from wedlm_client.cluster_generate import generate_on_cluster

    if args.draft_model:
        raise WedlmError("--draft-model is for --model (a cluster's coordinator loads its own)")
    with open_client(args) as client:
        result = generate_on_cluster(client, args, params_from_args(args), stream_of(args))
    return print_result(args, result)


def generate_on_this_machine(argv: Seq[str]) -> int:
    """`generate --model`: MLX generation is the server's, so `wedlm-coordinator generate`
    runs it with the same arguments, in its own process."""
    missing = [m for m in ("mlx", "mlx_lm") if importlib.util.find_spec(m) is None]
    if missing:  # the client-only install has no MLX
        raise WedlmError(
            f"local generation needs the server install ({missing[0]} is missing): "
            "pip install 'wedlm-cluster[server]', or pass --cluster HOST:PORT"
        )
    command = [sys.executable, "-m", "coordinator.service.server_cli", *argv]
    return subprocess.call(command)


def stream_of(args: argparse.Namespace):
    """Where streamed text goes: stdout, unless one JSON object is printed at the end."""
    return None if args.json else sys.stdout


def print_result(args: argparse.Namespace, result: dict) -> int:
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
    if result.get("warning"):
        print(f"wedlm: warning: {result['warning']}", file=sys.stderr)
    return 0


def run_status(args: argparse.Namespace) -> int:
    from wedlm_client.status_view import format_status

    with open_client(args, timeout=10.0) as client:
        status = client.status_dict()
    print(json.dumps(status) if args.json else format_status(status))
    return 0


def run_job_command(args: argparse.Namespace) -> int:
    """submit / job / wait / cancel: one JSON object on stdout."""
    from wedlm_client.client import job_dict

    with open_client(args) as client:
        if args.command == "submit":
            ids = list(args.prompt_ids) if args.prompt_ids else None
            job_id = client.submit(
                args.prompt, ids, args.chat, params_from_args(args), args.deadline
            )
            print(json.dumps({"job_id": job_id}))
            return 0
        if args.command == "job":
            job = client.get_job(args.job_id)
        elif args.command == "wait":
            job = client.wait_job(args.job_id, args.timeout)
        else:
            job = client.cancel_job(args.job_id)
    print(json.dumps(job_dict(job)))
    return 0


def main(argv: Seq[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        if args.command == "status":
            return run_status(args)
        if args.command == "generate":
            return run_generate(args, argv)
        if args.command == "bench":
            from wedlm_client.bench.cli import run_bench

            return run_bench(args, argv)
        return run_job_command(args)
    except WedlmError as e:
        print(f"wedlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
