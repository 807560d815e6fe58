"""`wedlm-coordinator serve --config cluster.toml`: the same settings as the flags, in a
file (see deploy/cluster.example.toml). Flags given on the command line win."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from common.errors import WedlmError
from common.layer_range import LayerRange
from coordinator.engine.limits import knobs
from coordinator.service.request_limits import MIN_REQUEST_BYTES

# key → (type, description) ; every key is optional
KEYS: dict[str, tuple[type, str]] = {
    "model": (str, "model folder, 'default' or a Hugging Face hub id"),
    "host": (str, "address to listen on"),
    "port": (int, "port"),
    "cluster": (str, "cluster name"),
    "secret_file": (str, "file holding the cluster secret"),
    "workers": (list, "static worker addresses HOST:PORT"),
    "expect": (int, "workers to wait for before the first plan"),
    "local_layers": (bool, "the coordinator holds the first layers itself"),
    "warm_up": (str, "run the first forward shapes before readiness: auto, on or off"),
    "layers": (str, "the coordinator's own layer range A-B (A = 0)"),
    "bonjour": (bool, "find workers over Bonjour"),
    "max_running": (int, "sequences decoded at once"),
    # the scheduler's settings, declared in coordinator/engine/limits.py
    **{f.name: (int, knob.help) for f, knob in knobs()},
    "micro_batches": (int, "micro-batches in flight"),
    "tp": (int, "workers per tensor-parallel group"),
    "metrics_port": (int, "Prometheus metrics HTTP port"),
    "kv_reserve_tokens": (int, "KV tokens reserved per worker when planning"),
    "keep_finished": (int, "finished jobs kept for GetJob/WaitJob"),
    "wait_timeout": (float, "seconds to wait for the layers to be covered"),
    "wait_for_workers": (float, "seconds to wait for the layers to be covered"),
    "state_dir": (str, "folder keeping accepted jobs (SQLite)"),
    "http_port": (int, "port of the OpenAI-compatible HTTP API"),
    "api_key_file": (str, "file holding the API key clients must send"),
    "served_model_name": (str, "the model's name in the APIs"),
    "draft_model": (str, "a small model drafting for speculative requests"),
    "kv_bits": (int, "quantized KV bits (8 or 4)"),
    "kv_group_size": (int, "quantized KV group size along the head dimension"),
    "prefix_cache": (bool, "reuse finished requests' KV for prompts that start the same way"),
    "prefix_cache_tokens": (int, "KV rows the prefix cache may keep"),
    "default_max_tokens": (int, "max tokens of an HTTP request that names no limit"),
    "max_request_bytes": (int, "the largest HTTP body or gRPC client message"),
    "cors_origins": (list, "browser origins the HTTP API answers cross-origin (CORS)"),
}

_NON_NEGATIVE = ("expect", *(f.name for f, knob in knobs() if knob.low == 0))
_ZERO_ALLOWED = ("port", "http_port", *_NON_NEGATIVE)  # 0 means something


def load_serve_config(path: str | Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise WedlmError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise WedlmError(f"{path}: not valid TOML: {e}") from None
    section = data.get("coordinator", data)
    out: dict[str, Any] = {}
    for key, value in section.items():
        if key not in KEYS:
            raise WedlmError(f"{path}: unknown setting {key!r} (known: {', '.join(KEYS)})")
        kind, what = KEYS[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            article = "an" if kind is int else "a"
            raise WedlmError(
                f"{path}: {key} ({what}) must be {article} {kind.__name__}, got {value!r}"
            )
        if key == "cors_origins" and not all(isinstance(o, str) and o for o in value):
            raise WedlmError(f'{path}: cors_origins must be a list of origins ("https://host")')
        if key == "workers" and not all(isinstance(w, str) and ":" in w for w in value):
            raise WedlmError(f'{path}: workers must be a list of "HOST:PORT" strings')
        if kind in (int, float) and value <= 0 and key not in _ZERO_ALLOWED:
            raise WedlmError(f"{path}: {key} must be positive, got {value}")
        if key == "warm_up" and value not in ("auto", "on", "off"):
            raise WedlmError(f"{path}: warm_up must be auto, on or off, got {value!r}")
        if key == "layers":
            try:
                first = LayerRange.parse(value).start
            except WedlmError as e:
                raise WedlmError(f"{path}: layers: {e}") from None
            if first != 0:
                raise WedlmError(
                    f"{path}: layers {value}: the coordinator's layers must start at 0 "
                    "(they come right after the embedding)"
                )
        if key in ("port", "http_port") and not 0 <= value <= 65535:
            raise WedlmError(f"{path}: {key} must be in [0, 65535], got {value}")
        if key == "max_request_bytes" and value < MIN_REQUEST_BYTES:
            raise WedlmError(f"{path}: {key} must be at least {MIN_REQUEST_BYTES}, got {value}")
        if key in _NON_NEGATIVE and value < 0:
            raise WedlmError(f"{path}: {key} must be 0 or more, got {value}")
        out["wait_timeout" if key == "wait_for_workers" else key] = value
    for file_key, key in (("secret_file", "secret"), ("api_key_file", "api_key")):
        if file_key in out:
            out[key] = _read_secret(path, file_key, Path(out.pop(file_key)).expanduser())
    return out


def _read_secret(path: Path, key: str, secret_path: Path) -> str:
    try:
        value = secret_path.read_text().strip()
    except OSError as e:
        raise WedlmError(f"{path}: cannot read {key} {secret_path}: {e}") from None
    if not value:
        raise WedlmError(f"{path}: {key} {secret_path} is empty")
    return value
