"""The Bonjour (mDNS/DNS-SD) advertisement of a worker: `_wedlm._tcp.local.` with a TXT
record. Both sides read and write it through this one definition."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

SERVICE_TYPE = "_wedlm._tcp.local."


@dataclass(frozen=True)
class WorkerAdvert:
    node_id: str
    cluster: str
    protocol: int
    device: str
    memory_total: int
    memory_available: int
    layers: str  # "a-b" when started with --layers, else ""
    model: str  # model identity (config fingerprint)
    model_name: str

    def to_txt(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_txt(cls, props: dict[bytes | str, bytes | str | None]) -> WorkerAdvert:
        """Parse a TXT record; raises ValueError naming the bad or missing field."""
        text = {
            (k.decode() if isinstance(k, bytes) else k): (
                v.decode() if isinstance(v, bytes) else (v or "")
            )
            for k, v in props.items()
        }
        values = {}
        for f in fields(cls):
            if f.name not in text:
                raise ValueError(f"advertisement lacks {f.name!r}")
            raw = text[f.name]
            try:
                values[f.name] = int(raw) if f.type in (int, "int") else raw
            except ValueError:
                raise ValueError(
                    f"advertisement field {f.name!r} is not a number: {raw!r}"
                ) from None
        return cls(**values)

    def instance_name(self) -> str:
        return f"{self.node_id}.{SERVICE_TYPE}"
