"""A setting declared once: a dataclass field whose metadata carries a `Knob` (its help,
bounds and names). `wedlm-coordinator serve` makes its flags (server_cli.py) and reads its
TOML keys (serve_config.py) from these fields, for the scheduler's `Limits`
(engine/limits.py) and the server's `ServeSettings` (service/serve_settings.py) alike."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

from common.env_switches import EnvVar


@dataclass(frozen=True)
class Knob:
    """How a field is set on the command line (--max-queued) and in the TOML file
    (max_queued). A field `name` gets the flag --name and the key `name` unless told."""

    help: str | None  # the flag's help (None: the flag shows none)
    low: float | None = 1  # the smallest number accepted (0: zero means something)
    high: float | None = None  # the largest number accepted
    what: str | None = None  # the setting in the TOML file's messages (default: help)
    expect: str = ""  # a flag's word for its value ("seconds"; default from the type)
    noun: str = ""  # what a flag's range message names ("port must be in [0, 65535]")
    choices: tuple = ()
    flags: tuple[str, ...] = ()  # its flags (default: --name; a bool true by default: --no-name)
    keys: tuple[str, ...] = ()  # its TOML keys (default: name; () with toml=False: none)
    toml: bool = True  # a TOML key as well as a flag
    parse: Callable[[str], Any] | None = None  # text -> value (raises ValueError), flag and TOML
    check: Callable[[Any], None] | None = None  # a TOML value's own rule (raises ValueError)
    env: EnvVar | None = None  # an environment variable giving the flag's default
    file_key: str = ""  # a TOML key naming a file that holds the value (a secret)
    serve_only: bool = False  # `serve`'s alone (`local` starts its own workers)
    metavar: str | None = None


def knob(default: Any, help: str | None, **more: Any) -> Any:
    """A dataclass field that is a setting (a mutable default: give a factory, e.g. list)."""
    metadata = {"knob": Knob(help, **more)}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def knobs(cls: type) -> list[tuple[Field, Knob]]:
    """The fields of dataclass `cls` that are settings, with their Knob."""
    return [(f, f.metadata["knob"]) for f in fields(cls) if "knob" in f.metadata]


def kind_of(cls: type, name: str) -> type:
    """The type of a setting's values (int for `int | None`, list for `list[str]`)."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def default_of(f: Field) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default
