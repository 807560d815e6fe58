"""Figures a start measured on this machine, kept for the next start: the draft break-even
per row bucket (step_timing.py), keyed by what it depends on (the model, MLX's version and
backend, this machine's device, the pipeline's shape). A coordinator that finds its key
here seeds StepCost from it and measures nothing; one that does not measures in the
background and writes it here. One JSON file in the cache folder, written atomically, so
two coordinators on one host never read half a file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

log = logging.getLogger(__name__)
FILE_NAME = "measured-step-costs.json"
VERSION = 1  # of the figures' meaning: a change of what is measured starts afresh
MAX_ENTRIES = 64  # the oldest go first


@dataclass(frozen=True)
class CostKey:
    model: str  # the model's identity (ModelConfig.identity)
    device: str  # host_info.device_description() of the coordinator
    stages: tuple[str, ...]  # each stage's layer count and device, in pipeline order
    micro_batches: int
    kv: str  # how the stages store KV (KVFormat's description)

    def text(self) -> str:
        parts = [f"v{VERSION}", f"mlx {mx.__version__}", self.model, self.device,
                 f"{self.micro_batches} in flight", self.kv, *self.stages]  # fmt: skip
        return " | ".join(parts)


class MeasuredCosts:
    """The file of measured figures (module docstring); `path` None: the default cache."""

    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            from common.default_model import default_cache_dir

            path = default_cache_dir() / FILE_NAME
        self.path = path

    def load(self, key: CostKey) -> dict | None:
        """{"ratios": {rows: ratio}, "measured_at": epoch s, "seconds": s} or None."""
        entry = self._read().get(key.text())
        if not isinstance(entry, dict):
            return None
        try:
            ratios = {int(r): float(v) for r, v in entry["ratios"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None  # an entry of another shape: measured again
        if not ratios or any(not v > 0 for v in ratios.values()):
            return None
        return {**entry, "ratios": ratios}

    def save(self, key: CostKey, ratios: dict[int, float], seconds: float) -> None:
        """Keep `ratios` for `key`; a cache folder that cannot be written is only logged."""
        if not ratios:
            return
        entries = self._read()
        entries[key.text()] = {
            "ratios": {str(r): round(v, 4) for r, v in sorted(ratios.items())},
            "measured_at": time.time(),
            "seconds": round(seconds, 2),
        }
        newest = sorted(entries.items(), key=lambda kv: kv[1].get("measured_at", 0))
        entries = dict(newest[-MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not keep the measured step cost in %s: %s", self.path, e)

    def _read(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text())
            if isinstance(data, dict):
                return data
        return {}
