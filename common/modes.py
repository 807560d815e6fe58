"""The decoding modes, declared once: the schemas, the CLIs, the request validation and the
engine all take their lists and their comparisons from here. A `StrEnum`, so a member
equals its string ("ar" == Mode.AR) and JSON, protobuf and existing strings keep working."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    # the served model's own decoding (diffusion for a diffusion model, wedlm for a
    # WeDLM-trained checkpoint, else ar: ModelConfig.default_mode); the engine resolves it
    # when a request arrives
    AUTO = "auto"
    WEDLM = "wedlm"  # WeDLM streaming parallel decoding (mask slots filled per forward)
    AR = "ar"  # plain autoregressive decoding
    SPECULATIVE = "speculative"  # drafts verified by one forward: AR's output exactly
    DIFFUSION = "diffusion"  # block diffusion: whole canvases denoised

    # A member reads as its word in repr too ('ar', not <Mode.AR: 'ar'>): the messages that
    # quote a request's mode with !r read the same whether it holds a member or a string.
    __repr__ = str.__repr__


# Plain strings (not members) in the declared order: argparse's messages and the errors
# that list them print them as they always did.
MODES: tuple[str, ...] = tuple(m.value for m in Mode)
DIFFUSION_MODES: tuple[str, ...] = (Mode.AUTO.value, Mode.DIFFUSION.value)  # a diffusion model's
CAUSAL_MODES: tuple[str, ...] = tuple(m for m in MODES if m != Mode.DIFFUSION)  # a causal one's

# Names of modes registered beyond the members above (coordinator/engine/modes/registry.py:
# a mode module of its own, e.g. a test's); requests may name them as they name a member.
_REGISTERED: set[str] = set()


def register_name(name: str) -> None:
    if name not in MODES:
        _REGISTERED.add(name)


def forget_name(name: str) -> None:
    _REGISTERED.discard(name)


def is_mode(name: object) -> bool:
    return name in MODES or name in _REGISTERED
