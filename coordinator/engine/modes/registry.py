"""The decoding modes this engine serves, by name. A mode registers once (modes/__init__.py
registers the built-in ones); a name registered beyond common/modes.py's `Mode` members
becomes a valid request mode too (common.modes.register_name)."""

from __future__ import annotations

from common import modes as mode_names
from common.errors import InvalidRequest
from coordinator.engine.modes.base import DecodingMode

_MODES: dict[str, DecodingMode] = {}


def register(mode: DecodingMode) -> DecodingMode:
    name = str(mode.name)
    if not name:
        raise ValueError(f"{type(mode).__name__} has no name")
    _MODES[name] = mode
    mode_names.register_name(name)
    return mode


def unregister(name: str) -> None:
    """Forget a mode registered beyond the built-in ones (a test's)."""
    _MODES.pop(str(name), None)
    mode_names.forget_name(str(name))


def registered() -> list[DecodingMode]:
    """In registration order: the order look-ahead launches are tried in."""
    return list(_MODES.values())


def served(name: str) -> bool:
    return str(name) in _MODES


def mode_of(name: str) -> DecodingMode:
    """The mode a (resolved) request decodes with."""
    try:
        return _MODES[str(name)]
    except KeyError:
        raise InvalidRequest(
            f"mode {name!r} is not served by this engine (it serves {', '.join(_MODES)})"
        ) from None
