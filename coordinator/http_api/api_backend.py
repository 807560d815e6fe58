"""What the HTTP API needs from the coordinator: admission into the engine, the
tokenizer, the served model's name and limits (context, request bytes), readiness,
metrics and the API key; and for the console, the cluster's status and what the status
does not carry."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.tokenizer import Tokenizer
from coordinator.service.admission import Admission
from coordinator.service.api_key import bearer_matches
from coordinator.service.metrics import Metrics


@dataclass
class ApiBackend:
    admission: Admission
    tokenizer: Tokenizer
    model_name: str
    context: int  # the model's positions
    max_request_bytes: int  # larger bodies are refused with 413 before they are read
    default_max_tokens: int  # when a request names no limit (capped by the context left)
    ready: Callable[[], bool]
    metrics: Metrics
    api_key: str | None = None
    alive: Callable[[], bool] = lambda: True  # False once the engine thread has stopped
    created: int = field(default_factory=lambda: int(time.time()))
    cors_origins: tuple[str, ...] = ()  # browser origins answered cross-origin (CORS)
    # The console (coordinator/console): `wedlm status`'s ClusterStatusReply, and a dict of
    # what it lacks (console_state.py reads both); None when the server has no cluster.
    cluster_status: Callable[[], Any] | None = None
    cluster_extras: Callable[[], dict[str, Any]] = dict
    num_layers: int = 0
    modes: tuple[str, ...] = ("auto",)  # the modes a request may name on this model

    @property
    def default_mode(self) -> str:
        """What a request that names no mode decodes with on this model."""
        return self.admission.engine.default_mode

    def key_matches(self, authorization: str | None) -> bool:
        return bearer_matches(authorization, self.api_key)
