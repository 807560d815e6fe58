"""Contiguous, inclusive ranges of transformer layers (`0-17` means layers 0..17)."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import WedlmError


@dataclass(frozen=True, order=True)
class LayerRange:
    start: int
    end: int  # inclusive, as users write it on the command line

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise WedlmError(f"invalid layer range {self.start}-{self.end}")

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        parts = text.strip().split("-")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise WedlmError(f"invalid layer range {text!r}: expected A-B, e.g. 0-17")
        start, end = int(parts[0]), int(parts[1])
        if end < start:
            raise WedlmError(f"invalid layer range {text!r}: end is before start")
        return cls(start, end)

    @classmethod
    def full(cls, num_layers: int) -> LayerRange:
        return cls(0, num_layers - 1)

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __iter__(self):
        return iter(range(self.start, self.end + 1))

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer <= self.end

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"
