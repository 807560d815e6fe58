"""The settings of `wedlm-coordinator serve` (and `local`), each declared once as a field
with its default, bounds and help (a `Knob`, coordinator/knobs.py): server_cli.py makes the
flags and serve_config.py reads the TOML keys from these fields and from the scheduler's
`Limits`. The server's `ServeOptions` (serve_options.py) is these fields plus what only code sets;
serve_args.py fills it from the parsed flags, field by field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.env_switches import API_KEY, SECRET
from common.errors import WedlmError
from common.kv_format import KV_BITS, KV_GROUP_SIZES
from common.layer_range import LayerRange
from coordinator.knobs import knob
from coordinator.service.request_limits import BYTES_PER_TOKEN, MIN_REQUEST_BYTES

PORT = {"low": 0, "high": 65535, "expect": "a port number", "noun": "port"}


def coordinator_layers(text: str) -> LayerRange:
    """--layers A-B: the coordinator's own layers, which start at 0."""
    try:
        layers = LayerRange.parse(text)
    except WedlmError as e:
        raise ValueError(str(e)) from None
    if layers.start != 0:
        raise ValueError(
            f"the coordinator's layers come right after the embedding: {text} must start at 0"
        )
    return layers


def tp_size(text: str) -> int | str:
    """--tp auto | N: the group size, or auto (chosen from measured links)."""
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    try:
        size = int(word)
    except ValueError:
        raise ValueError(f"expected auto or a whole number >= 1, got {text!r}") from None
    if size < 1:
        raise ValueError(f"a group has at least 1 member (1: a pipeline), got {size}")
    return size


def origins(text: str) -> list[str]:
    """--cors-origins a,b: comma-separated origins."""
    found = [o.strip() for o in text.split(",") if o.strip()]
    if not found:
        raise ValueError("expected origins such as https://host,http://host:3000")
    return found


def _origin_list(value: list) -> None:
    if not all(isinstance(o, str) and o for o in value):
        raise ValueError('must be a list of origins ("https://host")')


def _worker_list(value: list) -> None:
    if not all(isinstance(w, str) and ":" in w for w in value):
        raise ValueError('must be a list of "HOST:PORT" strings')


@dataclass
class ServeSettings:
    model: str | None = knob(
        None,
        "model folder, 'default', or a Hugging Face hub id (org/name)",
        what="model folder, 'default' or a Hugging Face hub id",
    )
    host: str = knob("127.0.0.1", "address to listen on")
    port: int = knob(50051, "port (0 = any free port)", what="port", **PORT)
    cluster: str = knob("default", "cluster name (workers must match)", what="cluster name")
    secret: str | None = knob(
        None, "cluster secret", env=SECRET, toml=False, file_key="secret_file",
        what="file holding the cluster secret",
    )  # fmt: skip
    workers: list[str] = knob(
        list,
        "a worker to use besides those found over Bonjour (repeatable)",
        what="static worker addresses HOST:PORT",
        flags=("--worker",),
        metavar="HOST:PORT",
        check=_worker_list,
        serve_only=True,
    )
    expect: int = knob(
        0,
        "wait for N workers before the first plan (default 0: serve as soon as the layers "
        "are covered, taking later workers in by re-planning)",
        what="workers to wait for before the first plan",
        low=0,
        serve_only=True,
    )
    bonjour: bool = knob(
        True, "use only --worker", what="find workers over Bonjour", serve_only=True
    )
    local_layers: bool = knob(
        True,
        "hold no layers in the coordinator (a small machine): workers hold them all",
        what="the coordinator holds the first layers itself",
    )
    warm_up: str = knob(
        "auto",
        "run the first forward shapes once, so that the first requests do not wait for "
        "kernel compilation (auto: on GPUs, one request's shapes before readiness and "
        "the larger batches' while the engine is idle; on: all of them before "
        "readiness; MLX's CPU backend compiles nothing per shape, so there auto only "
        "measures the draft break-even of a pipeline of stages)",
        what="run the first forward shapes before readiness: auto, on or off",
        choices=("auto", "on", "off"),
    )
    layers: LayerRange | None = knob(
        None,
        "the coordinator holds exactly layers A-B itself (A must be 0: its layers come "
        "right after the embedding); default: a share of the model planned by memory",
        what="the coordinator's own layer range A-B (A = 0)",
        parse=coordinator_layers,
    )
    max_running: int | None = knob(
        None,
        "sequences decoded at once (default: as many typical requests as the measured "
        "free memory holds, up to 64; the startup log and `wedlm status` say why)",
        what="sequences decoded at once",
    )
    micro_batches: int | None = knob(
        None,
        "micro-batches in flight (default: one per stage, one more when the coordinator leads "
        "a tensor group)",
        what="micro-batches in flight",
    )
    tp: int | str = knob(
        "auto",
        "tensor parallelism: members form groups of N that each hold one stage's layers "
        "split N ways over mlx.distributed (ring, or nccl on CUDA), so one answer runs on N "
        "machines at once; the coordinator leads the first group. auto (the default) "
        "measures each pair of members' link and each one's memory reads and groups them "
        "only where the projected time per token beats a pipeline; 1 forces a pipeline; N "
        "forces groups of N. What cannot be grouped (heads that do not divide, a model "
        "without mlx-lm's Model.shard, a worker started with --layers) stays a pipeline "
        "stage, as `wedlm status` says",
        what="tensor-parallel group size (auto or N >= 1)",
        parse=tp_size,
        metavar="auto|N",
    )
    metrics_port: int | None = knob(
        None,
        "serve Prometheus metrics on this HTTP port (0: any free port)",
        what="Prometheus metrics HTTP port",
        **PORT,
    )
    http_port: int | None = knob(
        None,
        "also serve the OpenAI-compatible HTTP API on this port (0 = any free port)",
        what="port of the OpenAI-compatible HTTP API",
        **PORT,
    )
    api_key: str | None = knob(
        None,
        "clients must send 'Authorization: Bearer KEY' (HTTP and gRPC; default: $WEDLM_API_KEY)",
        what="file holding the API key clients must send",
        env=API_KEY,
        toml=False,
        file_key="api_key_file",
    )
    served_model_name: str | None = knob(
        None, "the model's name in the APIs (default: folder)", what="the model's name in the APIs"
    )
    cors_origins: list[str] | None = knob(
        None,
        "browser origins the HTTP API answers cross-origin requests from (CORS), "
        "comma-separated, e.g. https://chat.example.com ('*': any); default: none",
        what="browser origins the HTTP API answers cross-origin (CORS)",
        metavar="ORIGIN,...",
        parse=origins,
        check=_origin_list,
    )
    kv_bits: int | None = knob(
        None,
        "store keys and values quantized to this many bits on every stage (default: "
        "the model's dtype); attention then runs through mlx-lm's quantized path",
        what="quantized KV bits (8 or 4)",
        choices=KV_BITS,
    )
    kv_group_size: int = knob(
        64,
        "quantization group along the head dimension, with --kv-bits",
        what="quantized KV group size along the head dimension",
        choices=KV_GROUP_SIZES,
    )
    prefix_cache_tokens: int | None = knob(
        None,
        "KV rows of finished requests kept for reuse by later prompts that start the "
        "same way (default: half of the KV the stages' free memory holds)",
        what="KV rows the prefix cache may keep",
    )
    prefix_cache: bool = knob(
        True,
        "prefill every prompt from scratch (no reuse of earlier requests' KV)",
        what="reuse finished requests' KV for prompts that start the same way",
    )
    draft_model: str | None = knob(
        None,
        "a small model with the served model's tokenizer, run on the coordinator to "
        "draft tokens for speculative requests (draft 'model'; 'auto' then prefers it)",
        what="a small model drafting for speculative requests",
    )
    default_max_tokens: int = knob(
        2048,
        "max tokens of an HTTP request that names no limit (capped by the context)",
        what="max tokens of an HTTP request that names no limit",
    )
    max_request_bytes: int | None = knob(
        None,
        "the largest HTTP request body and gRPC client message; larger ones are refused "
        "(413, RESOURCE_EXHAUSTED) before they are read (default: the model's context "
        f"times {BYTES_PER_TOKEN} bytes, plus 1 MiB)",
        what="the largest HTTP body or gRPC client message",
        low=MIN_REQUEST_BYTES,
        expect="a number of bytes",
    )
    kv_reserve_tokens: int = knob(32768, None, what="KV tokens reserved per worker when planning")
    keep_finished: int = knob(
        10_000,
        "finished jobs kept for GetJob/WaitJob (the oldest are forgotten beyond it)",
        what="finished jobs kept for GetJob/WaitJob",
    )
    wait_timeout: float = knob(
        600.0,
        "seconds to wait for the layers to be covered before giving up with a message "
        "naming what is missing (workers that come later are taken in at any time)",
        what="seconds to wait for the layers to be covered",
        low=1e-3,
        expect="seconds",
        flags=("--wait-for-workers", "--wait-timeout"),
        keys=("wait_timeout", "wait_for_workers"),
    )
    tls_cert: str | None = knob(
        None,
        "PEM certificate: serve clients over TLS, and present it to workers that require "
        "client certificates",
        toml=False,
    )
    tls_key: str | None = knob(None, "PEM private key of --tls-cert", toml=False)
    tls_ca: str | None = knob(None, "PEM CA that workers' certificates must chain to", toml=False)
    state_dir: Path | None = knob(
        None,
        "keep accepted jobs and results here (SQLite), so a restart loses none "
        "(default: the user state folder; 'none' keeps nothing)",
        what="folder keeping accepted jobs (SQLite)",
        parse=Path,
    )
