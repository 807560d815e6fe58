"""The wire between a member (worker or coordinator) and its group process: msgpack maps,
each preceded by its length, over the child's stdin and stdout. A forward travels as its
RowsSpec's arrays and the hidden states' raw bytes (the same dtype enum and bytes as on gRPC)."""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

import msgpack
import numpy as np

from common.rows_spec import RowsSpec
from common.wire_frames import WireTensor

_LEN = struct.Struct(">I")


class PipeClosed(EOFError):
    """The other end closed the pipe (the process ended)."""


def write_frame(out: BinaryIO, message: dict[str, Any]) -> None:
    body = pack(message)
    out.write(_LEN.pack(len(body)) + body)
    out.flush()


def read_body(src: BinaryIO) -> bytes:
    """One frame's packed message, as it came."""
    head = src.read(_LEN.size)
    if len(head) < _LEN.size:
        raise PipeClosed("the pipe closed")
    (size,) = _LEN.unpack(head)
    body = src.read(size)
    if len(body) < size:
        raise PipeClosed("the pipe closed mid-message")
    return body


def read_frame(src: BinaryIO) -> dict[str, Any]:
    return unpack(read_body(src))


def unpack(body: bytes) -> dict[str, Any]:
    return msgpack.unpackb(body, raw=False)


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _array(a: np.ndarray | None) -> list | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    return [a.dtype.str, list(a.shape), a.tobytes()]


def _unarray(v: list | None) -> np.ndarray | None:
    if v is None:
        return None
    dtype, shape, data = v
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()


def spec_message(spec: RowsSpec) -> dict[str, Any]:
    if spec.visibility is not None:
        raise ValueError("a device-side visibility never leaves its process")
    return {
        "seq_ids": list(spec.seq_ids),
        "starts": _array(spec.starts),
        "widths": _array(spec.widths),
        "filled": _array(spec.filled),
        "keeps": _array(spec.keeps),
        "forks": [list(f) for f in spec.forks],
        "canvas": _array(spec.canvas),
        "offsets": _array(spec.offsets),
        "extent": _array(spec.extent),
    }


def spec_of(message: dict[str, Any]) -> RowsSpec:
    return RowsSpec(
        seq_ids=list(message["seq_ids"]),
        starts=_unarray(message["starts"]),
        widths=_unarray(message["widths"]),
        filled=_unarray(message["filled"]),
        keeps=_unarray(message["keeps"]),
        forks=[tuple(f) for f in message["forks"]],
        canvas=_unarray(message["canvas"]),
        offsets=_unarray(message["offsets"]),
        extent=_unarray(message["extent"]),
    )


def tensor_message(t: WireTensor) -> list:
    return [int(t.dtype), [int(d) for d in t.shape], bytes(t.data)]


def tensor_of(v: list) -> WireTensor:
    return WireTensor(int(v[0]), tuple(v[1]), v[2])


def slots_message(slots: np.ndarray | None) -> list | None:
    return _array(slots)


def slots_of(v: list | None) -> np.ndarray | None:
    return _unarray(v)
