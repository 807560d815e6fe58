"""`wedlm-coordinator serve --config cluster.toml`: the same settings as the flags, in a
file (see deploy/cluster.example.toml). Flags given on the command line win. The keys, their
types and their bounds are the fields of ServeSettings and Limits (coordinator/knobs.py)."""

from __future__ import annotations

import tomllib
from dataclasses import Field
from pathlib import Path
from typing import Any

from common.errors import WedlmError
from coordinator.engine.limits import Limits
from coordinator.knobs import Knob, kind_of, knobs
from coordinator.service.serve_settings import ServeSettings


def serve_knobs() -> list[tuple[type, Field, Knob]]:
    """Every setting of `serve`: the server's, then the scheduler's."""
    return [(cls, f, k) for cls in (ServeSettings, Limits) for f, k in knobs(cls)]


def _keys() -> dict[str, tuple[str, type, Knob]]:
    """TOML key -> (the setting's field, the key's value type, its Knob)."""
    out = {}
    for cls, f, k in serve_knobs():
        kind = kind_of(cls, f.name)
        if k.toml:
            toml_kind = str if k.parse is not None and kind is not list else kind
            for key in k.keys or (f.name,):
                out[key] = (f.name, toml_kind, k)
        if k.file_key:
            out[k.file_key] = (f.name, str, k)
    return out


KEYS = _keys()


def either(choices: tuple) -> str:
    """'a, b or c'"""
    words = [str(c) for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def out_of_bounds(key: str, value: float, k: Knob) -> str:
    """Why a number is refused ("" when it is accepted)."""
    low = k.low if k.low is not None else float("-inf")
    if k.high is not None and not low <= value <= k.high:
        return f"{key} must be in [{k.low:g}, {k.high:g}], got {value}"
    if value <= 0 < low:
        return f"{key} must be positive, got {value}"
    if value < low:
        return f"{key} must be 0 or more, got {value}" if low == 0 else (
            f"{key} must be at least {low:g}, got {value}"
        )  # fmt: skip
    return ""


def load_serve_config(path: str | Path) -> dict[str, Any]:
    """The file's settings by field name (secret files read, aliases resolved)."""
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
        name, kind, k = KEYS[key]
        out[name] = _value(path, key, value, kind, k)
    return out


def _value(path: Path, key: str, value: Any, kind: type, k: Knob) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if k.parse is not None and kind is str and type(value) is int:
        value = str(value)  # a setting read from text takes a number as well (tp = 2)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        article = "an" if kind is int else "a"
        what = k.what or k.help
        raise WedlmError(f"{path}: {key} ({what}) must be {article} {kind.__name__}, got {value!r}")
    if key == k.file_key:
        return _read_secret(path, key, Path(value).expanduser())
    try:
        if k.check is not None:
            k.check(value)
    except ValueError as e:  # "must be ..."
        raise WedlmError(f"{path}: {key} {e}") from None
    try:
        if k.parse is not None and isinstance(value, str):
            value = k.parse(value)
    except ValueError as e:
        raise WedlmError(f"{path}: {key}: {e}") from None
    if k.choices and value not in k.choices:
        raise WedlmError(f"{path}: {key} must be {either(k.choices)}, got {value!r}")
    if kind in (int, float) and not k.choices and (why := out_of_bounds(key, value, k)):
        raise WedlmError(f"{path}: {why}")
    return value


def _read_secret(path: Path, key: str, secret_path: Path) -> str:
    try:
        value = secret_path.read_text().strip()
    except OSError as e:
        raise WedlmError(f"{path}: cannot read {key} {secret_path}: {e}") from None
    if not value:
        raise WedlmError(f"{path}: {key} {secret_path} is empty")
    return value
