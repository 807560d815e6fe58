"""What `wedlm-coordinator serve` runs with: the serve settings, resolved."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.kv_format import KVFormat
from common.tls import TlsConfig, load_tls
from coordinator.engine.limits import Limits
from coordinator.service.serve_settings import ServeSettings


@dataclass
class ServeOptions(ServeSettings):
    """What the server runs with: every setting is a field of ServeSettings (declared once,
    with its flag, TOML key and default), filled from the flags and the TOML file by
    serve_args.py. Declared here: the settings' resolved forms and what only code sets."""

    model: Path  # the model's folder (the setting's folder or hub id, resolved)
    draft_model: Path | None = None  # its folder (resolved like the model's)
    limits: Limits = field(default_factory=Limits)  # the queue and prefill settings
    recovery_timeout_s: float = 600.0  # how long to wait for workers after a loss
    cost_cache: Path | None = None  # the measured step costs' file (None: the cache folder)
    # made from the settings (__post_init__): how every stage stores KV, the TLS files read
    kv: KVFormat = field(init=False)
    tls: TlsConfig = field(init=False)  # serves clients, dials workers

    def __post_init__(self) -> None:
        self.kv = KVFormat(self.kv_bits, self.kv_group_size)
        self.tls = load_tls(self.tls_cert, self.tls_key, self.tls_ca)
        self.api_key = self.api_key or None  # an empty $WEDLM_API_KEY: no key
        self.cors_origins = tuple(self.cors_origins or ())  # what ApiBackend keeps
