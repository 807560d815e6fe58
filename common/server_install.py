"""The serving commands need the [server] extra; the base install is only the client."""

from __future__ import annotations

import importlib.util
import os
import sys

SERVER_MODULES = ("mlx", "mlx_lm", "transformers", "zeroconf", "fastapi", "uvicorn")


def missing_server_modules() -> list[str]:
    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


def require_server_install(prog: str) -> None:
    """Exit with a clear message (not an ImportError deep in a stack) when missing."""
    # transformers (tokenizers only here) advises installing PyTorch when imported
    # without it: serving never needs PyTorch, so that line would only mislead.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    missing = missing_server_modules()
    if missing:
        print(
            f"{prog}: error: this install is the client only ({', '.join(missing)} missing); "
            "machines that serve need: pip install 'wedlm-cluster[server]'",
            file=sys.stderr,
        )
        sys.exit(2)
