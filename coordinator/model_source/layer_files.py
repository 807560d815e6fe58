"""A checkpoint's layers as one safetensors file each, read straight from the checkpoint's
own files: each layer's file is a fresh header over the layer's tensors, whose bytes are
copied from where they lie (no MLX, no decoding, the same bytes the checkpoint stores).
The safetensors library reads tensors but does not say where their bytes are, which is
what serving ranges of a file needs, so the header is read here (8-byte length, JSON)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common.checkpoint_weights import layer_file_name, layer_of, weight_files
from common.errors import CheckpointError

CHUNK = 4 << 20  # bytes per streamed chunk: large enough that gRPC's per-message cost is small


@dataclass(frozen=True)
class Segment:
    path: Path
    offset: int  # absolute offset of the tensor's bytes in `path`
    length: int


@dataclass(frozen=True)
class LayerFile:
    layer: int
    header: bytes  # the 8-byte length and the JSON header of the served file
    segments: tuple[Segment, ...]  # the tensors' bytes, in header order

    @property
    def name(self) -> str:
        return layer_file_name(self.layer)

    @property
    def size(self) -> int:
        return len(self.header) + sum(s.length for s in self.segments)


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name → dtype, shape, data_offsets) and where its
    data begins."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    return header, 8 + length


def _layer_file(layer: int, tensors: list[tuple[str, dict, Path, int]], fmt: str) -> LayerFile:
    """The tensors in the order they lie in the checkpoint's files, so that the served file
    is a few contiguous runs of them (read with one call per chunk)."""
    header: dict = {"__metadata__": {"format": fmt}}
    segments: list[Segment] = []
    at = 0
    for name, entry, path, data_start in sorted(
        tensors, key=lambda t: (str(t[2]), t[1]["data_offsets"][0])
    ):
        begin, end = entry["data_offsets"]
        span = [at, at + end - begin]
        header[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": span}
        last = segments[-1] if segments else None
        if (
            last is not None
            and last.path == path
            and last.offset + last.length == data_start + begin
        ):
            segments[-1] = Segment(path, last.offset, last.length + end - begin)  # contiguous
        else:
            segments.append(Segment(path, data_start + begin, end - begin))
        at += end - begin
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return LayerFile(layer, struct.pack("<Q", len(blob)) + blob, tuple(segments))


class LayerFiles:
    """Every layer of the checkpoint at `path`, served as files; checksums are computed once
    per process (on first demand) and kept."""

    def __init__(self, path: Path, num_layers: int) -> None:
        grouped: dict[int, list] = {i: [] for i in range(num_layers)}
        fmt = "pt"
        for f in weight_files(path):
            header, data_start = read_header(f)
            fmt = (header.get("__metadata__") or {}).get("format", fmt)
            for name, entry in header.items():
                layer = layer_of(name)
                if name == "__metadata__" or layer is None:
                    continue
                if layer not in grouped:
                    raise CheckpointError(
                        f"{f}: tensor {name} is past the model's {num_layers} layers"
                    )
                grouped[layer].append((name, entry, f, data_start))
        empty = [i for i, tensors in grouped.items() if not tensors]
        if empty:
            raise CheckpointError(f"{path}: no tensors for layer(s) {empty[:8]}")
        self.files = {i: _layer_file(i, tensors, fmt) for i, tensors in grouped.items()}
        self._sha256: dict[int, str] = {}
        self._lock = threading.Lock()

    def __getitem__(self, layer: int) -> LayerFile:
        return self.files[layer]

    def chunks(self, layer: int, offset: int = 0) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) of the layer's file from `offset` on, in pieces of at most CHUNK
        (read straight from the checkpoint, no copying into buffers)."""
        lf = self.files[layer]
        pos = 0
        if offset < len(lf.header):
            yield offset, lf.header[offset:]
        for seg in lf.segments:
            start = len(lf.header) + pos
            pos += seg.length
            skip = max(offset - start, 0)
            if skip >= seg.length:
                continue
            at = start + skip
            for data in _read_range(seg.path, seg.offset + skip, seg.length - skip):
                yield at, data
                at += len(data)

    def sha256(self, layer: int) -> str:
        with self._lock:
            known = self._sha256.get(layer)
        if known is None:
            digest = hashlib.sha256()
            for _, data in self.chunks(layer):
                digest.update(data)
            known = digest.hexdigest()
            self.remember_sha256(layer, known)
        return known

    def remember_sha256(self, layer: int, value: str) -> None:
        with self._lock:
            self._sha256[layer] = value

    def known_sha256(self, layer: int) -> str | None:
        with self._lock:
            return self._sha256.get(layer)


def _read_range(path: Path, offset: int, length: int) -> Iterator[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        while length > 0:
            data = os.pread(fd, min(length, CHUNK), offset)
            if not data:
                raise CheckpointError(f"{path} ends before the tensor bytes its header lists")
            yield data
            offset += len(data)
            length -= len(data)
    finally:
        os.close(fd)
