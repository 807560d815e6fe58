"""The folder where a worker keeps the layers it fetched: one subfolder per model identity,
each a checkpoint folder (config.json and one safetensors file per layer) that
`load_model_parts` reads like any other. Partial files end in `.part` and are resumed.
Room is made before a fetch: other models' folders go first (least recently used), then
this model's layers outside the range it needs; what still does not fit is refused with
the numbers."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path

from common.checkpoint_weights import layer_file_name
from common.errors import WedlmError
from common.layer_range import LayerRange
from common.model_config import ModelConfig, load_model_config

log = logging.getLogger(__name__)
PART = ".part"
SOURCE_FILE = "source.json"  # the model's name as the coordinator serves it
DISK_MARGIN = 64 << 20  # left free on the disk after a fetch
_LAYER_PREFIX, _LAYER_SUFFIX = "model-layer-", ".safetensors"


class CacheFull(WedlmError):
    """The layers to fetch do not fit on the disk or under the cache's size cap."""


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def _layer_number(name: str) -> int | None:
    if name.startswith(_LAYER_PREFIX) and name.endswith(_LAYER_SUFFIX):
        digits = name[len(_LAYER_PREFIX) : -len(_LAYER_SUFFIX)]
        return int(digits) if digits.isdigit() else None
    return None


def sha256_file(path: Path, digest=None) -> str:
    digest = digest or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class LayerCache:
    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        """`max_bytes`: a cap on the whole folder; None keeps only the model in use (other
        models' layers are removed when a fetch needs room or the model changes)."""
        self.root = Path(root).expanduser()
        self.max_bytes = max_bytes
        self._verified: dict[Path, tuple[int, int, str]] = {}  # path → (size, mtime, sha)
        self._lock = threading.Lock()

    # ---- a model's folder ------------------------------------------------------------
    def model_dir(self, identity: str) -> Path:
        if not identity or not all(c in "0123456789abcdef" for c in identity):
            raise WedlmError(f"invalid model identity {identity!r}")
        return self.root / identity

    def layer_path(self, identity: str, layer: int) -> Path:
        return self.model_dir(identity) / layer_file_name(layer)

    def part_path(self, identity: str, layer: int) -> Path:
        path = self.layer_path(identity, layer)
        return path.with_name(path.name + PART)

    def store_config(self, identity: str, config_json: bytes, model_name: str) -> ModelConfig:
        """Write the model's config.json (checked against its identity) and return it."""
        folder = self.model_dir(identity)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / "config.json.tmp"
        tmp.write_bytes(config_json)
        os.replace(tmp, folder / "config.json")
        (folder / SOURCE_FILE).write_text(json.dumps({"model_name": model_name}))
        config = load_model_config(folder)
        if config.identity != identity:
            raise WedlmError(
                f"the coordinator's config.json has identity {config.identity}, not the "
                f"{identity} it announced"
            )
        return config

    def model_name(self, identity: str) -> str:
        try:
            return json.loads((self.model_dir(identity) / SOURCE_FILE).read_text())["model_name"]
        except (OSError, ValueError, KeyError):
            return identity

    def touch(self, identity: str) -> None:
        """Mark the model as just used (eviction takes the least recently used first)."""
        folder = self.model_dir(identity)
        if folder.exists():
            os.utime(folder)

    def cached_layers(self, identity: str) -> dict[int, Path]:
        folder = self.model_dir(identity)
        if not folder.is_dir():
            return {}
        out = {}
        for f in folder.iterdir():
            layer = _layer_number(f.name)
            if layer is not None and f.is_file():
                out[layer] = f
        return out

    # ---- checksums -------------------------------------------------------------------
    def matches(self, path: Path, sha256: str) -> bool:
        """Whether the file's bytes have this checksum (hashed once per process while the
        file keeps its size and modification time)."""
        st = path.stat()
        with self._lock:
            seen = self._verified.get(path)
        if seen is not None and seen[:2] == (st.st_size, st.st_mtime_ns):
            return seen[2] == sha256
        actual = sha256_file(path)
        self.remember(path, actual)
        return actual == sha256

    def remember(self, path: Path, sha256: str) -> None:
        st = path.stat()
        with self._lock:
            self._verified[path] = (st.st_size, st.st_mtime_ns, sha256)

    # ---- room ------------------------------------------------------------------------
    def total_bytes(self) -> int:
        return folder_bytes(self.root) if self.root.is_dir() else 0

    def make_room(self, identity: str, keep: LayerRange, range_bytes: int, need: int) -> None:
        """Free space for `need` more bytes of layers `keep` (whose files take `range_bytes`
        once complete), or raise CacheFull saying what is missing."""
        if self.max_bytes is not None and range_bytes > self.max_bytes:
            raise CacheFull(
                f"layers {keep} take {_gb(range_bytes)}, more than the cache's cap of "
                f"{_gb(self.max_bytes)} (--cache-max-gb)"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        victims = self._victims(identity, keep)
        free = shutil.disk_usage(self.root).free
        reclaimable = sum(folder_bytes(v) if v.is_dir() else v.stat().st_size for v in victims)
        if free + reclaimable < need + DISK_MARGIN:  # refuse before removing anything
            raise CacheFull(
                f"not enough disk space for layers {keep} in {self.root}: {_gb(need)} to "
                f"fetch, {_gb(free)} free (free some space or point --cache-dir elsewhere)"
            )
        for victim in victims:
            if self._fits(need, drop_others=self.max_bytes is None, identity=identity):
                break
            size = folder_bytes(victim) if victim.is_dir() else victim.stat().st_size
            log.info("cache: removing %s (%s) to make room", victim, _gb(size))
            self._remove(victim)
        free = shutil.disk_usage(self.root).free
        if free < need + DISK_MARGIN:
            raise CacheFull(
                f"not enough disk space for layers {keep} in {self.root}: {_gb(need)} to "
                f"fetch, {_gb(free)} free (free some space or point --cache-dir elsewhere)"
            )

    def _fits(self, need: int, drop_others: bool, identity: str) -> bool:
        if drop_others and any(
            p.is_dir() and p.name != identity for p in self.root.iterdir()
        ):
            return False  # without a cap only the model in use is kept
        if shutil.disk_usage(self.root).free < need + DISK_MARGIN:
            return False
        return self.max_bytes is None or self.total_bytes() + need <= self.max_bytes

    def _victims(self, identity: str, keep: LayerRange) -> list[Path]:
        others = [p for p in self.root.iterdir() if p.is_dir() and p.name != identity]
        others.sort(key=lambda p: p.stat().st_mtime)  # least recently used first
        own = [
            p for layer, p in sorted(self.cached_layers(identity).items()) if layer not in keep
        ]
        return others + own

    def _remove(self, path: Path) -> None:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        with self._lock:
            for p in [p for p in self._verified if p == path or path in p.parents]:
                del self._verified[p]

    def clear(self) -> int:
        """Remove every cached model; the bytes freed."""
        if not self.root.is_dir():
            return 0
        freed = 0
        for entry in self.root.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                freed += folder_bytes(entry)
                self._remove(entry)
        return freed

    def drop_file(self, path: Path) -> None:
        self._remove(path)
