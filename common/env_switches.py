"""Every WEDLM_* environment variable, declared and read here and nowhere else: the ones
users set (a secret kept off the command line, where `ps` shows it; a cache folder), then
the switches that only tests and benchmarks flip (A/B runs of a kernel, injected faults,
shorter timeouts). A module reads one through its `EnvVar` (`FUSED_PROJECTIONS.read()`).
Plain Python only: the client install reads the API key's."""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.errors import WedlmError


@dataclass(frozen=True)
class EnvVar:
    name: str
    means: str  # what it does, for the list below and its messages
    default: str | None = None  # the value when it is unset

    def read(self) -> str | None:
        """Its value now (read on each call: a test or an A/B run may set it in-process)."""
        return os.environ.get(self.name, self.default)

    def number(self) -> float | None:
        """Its value as a number (None: unset without a default); a bad one in one line."""
        text = self.read()
        if text is None:
            return None
        try:
            return float(text)
        except ValueError:
            raise WedlmError(f"{self.name} must be a number ({self.means}), got {text!r}") from None


# What users set.
SECRET = EnvVar("WEDLM_SECRET", "the cluster secret of serve, the workers and bench")
API_KEY = EnvVar("WEDLM_API_KEY", "the API key clients send and a coordinator requires")
CACHE_DIR = EnvVar("WEDLM_CACHE_DIR", "the cache folder (default model, measured costs)")
DEFAULT_GGUF = EnvVar("WEDLM_DEFAULT_GGUF", "a local copy of the default model's GGUF (offline)")

# What only tests and benchmarks flip.
FAULT_FILE = EnvVar("WEDLM_FAULT_FILE", "a file a test writes faults into (fault_hooks.py)")
FUSED_PROJECTIONS = EnvVar(
    "WEDLM_FUSED_PROJECTIONS", "0 keeps the layers' own projections (A/B runs)", "1"
)
SMALL_QUERY_ATTENTION = EnvVar(
    "WEDLM_SMALL_QUERY_ATTENTION",
    "0 turns the small-query attention kernel off, wide keeps one query row on MLX's path",
    "1",
)
MOE_GROUPED = EnvVar("WEDLM_MOE_GROUPED", "1/0 forces diffusion MoE's grouped experts on/off")
GROUP_BOUND_S = EnvVar(
    "WEDLM_GROUP_BOUND_S", "seconds a tensor group's forward may take before a member is lost", "20"
)
GROUP_LAUNCH_EVERY = EnvVar(
    "WEDLM_GROUP_LAUNCH_EVERY", "layers per launched chunk of a tensor group's forward"
)

USER_VARIABLES = (SECRET, API_KEY, CACHE_DIR, DEFAULT_GGUF)
TEST_SWITCHES = (
    FAULT_FILE,
    FUSED_PROJECTIONS,
    SMALL_QUERY_ATTENTION,
    MOE_GROUPED,
    GROUP_BOUND_S,
    GROUP_LAUNCH_EVERY,
)
