"""The client of a wedlm-cluster coordinator: gRPC only, no MLX (see `client.py`).

The client class loads grpc and the generated stubs on first use, not when the package is
imported: `wedlm generate --model` (local generation, in this package's CLI) talks no gRPC
and imports none of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.generation_params import GenerationParams

if TYPE_CHECKING:
    from wedlm_client.client import ClusterError, WedlmClient, final_dict, job_dict

__all__ = ["ClusterError", "GenerationParams", "WedlmClient", "final_dict", "job_dict"]
_FROM_CLIENT = frozenset(__all__) - {"GenerationParams"}


def __getattr__(name: str):
    if name in _FROM_CLIENT:
        from wedlm_client import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
