"""Serialized Forward messages with their hidden states framed by hand.

Setting and serializing a large nested bytes field through the protobuf runtime copies the
payload several times (a message copy on assignment, then growing serialization buffers):
for a 4 MiB tensor that cost more than the gRPC transfer itself. Here the small fields go
through protobuf as usual and the tensor field is appended as raw wire bytes, so the payload
is copied once. The result is byte-for-byte a valid message of the generated class: the
receiver parses it with the ordinary `FromString`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from google.protobuf.message import DecodeError, Message

from common.proto_gen import wedlm_pb2 as pb

_LEN = 2  # protobuf wire type of bytes and nested messages
_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_DTYPE = pb.Tensor.DESCRIPTOR.fields_by_name["dtype"].number
_SHAPE = pb.Tensor.DESCRIPTOR.fields_by_name["shape"].number


class WireTensor(NamedTuple):
    """A received tensor: dtype, shape and its raw bytes (a view of the received message
    when parsed by `framed_parser`, so the payload is not copied)."""

    dtype: int
    shape: tuple[int, ...]
    data: bytes | memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int) -> bytes:
    return _varint(field << 3 | _LEN)


class TensorFrame:
    """A tensor's wire bytes in parts: its small fields, then the raw data (not copied)."""

    def __init__(self, dtype: int, shape: Sequence[int], data) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:  # a flat byte view of a contiguous buffer
            view = view.cast("B") if view.nbytes else memoryview(b"")
        self.data = view
        head = pb.Tensor(dtype=dtype, shape=list(shape)).SerializeToString()
        self.parts = [head, _key(_DATA), _varint(self.data.nbytes), self.data]
        self.nbytes = len(head) + len(self.parts[1]) + len(self.parts[2]) + self.data.nbytes

    @classmethod
    def of(cls, tensor: pb.Tensor) -> TensorFrame:
        """Re-frame a parsed tensor (relaying it to the next worker)."""
        return cls(tensor.dtype, tensor.shape, tensor.data)

    @classmethod
    def of_array(cls, dtype: int, array: np.ndarray) -> TensorFrame:
        return cls(dtype, array.shape, np.ascontiguousarray(array))


def with_tensor(message: Message, field: str, frame: TensorFrame) -> bytes:
    """`message` serialized with its tensor field `field` set to `frame` (the field must
    not be set on `message` itself: protobuf would merge the two)."""
    number = message.DESCRIPTOR.fields_by_name[field].number
    if message.HasField(field):
        raise ValueError(f"{field} is set on the message; it is framed by hand")
    return b"".join(
        [message.SerializeToString(), _key(number), _varint(frame.nbytes), *frame.parts]
    )


def with_bytes(message: Message, field: str, data: bytes | memoryview) -> bytes:
    """`message` serialized with its bytes field `field` set to `data`, copied once (a
    streamed file chunk: protobuf's own serialization copies it at a fraction of the
    speed of a plain join)."""
    number = message.DESCRIPTOR.fields_by_name[field].number
    if getattr(message, field):
        raise ValueError(f"{field} is set on the message; it is framed by hand")
    return b"".join([message.SerializeToString(), _key(number), _varint(len(data)), data])


class Framed:
    """A received message whose tensor field was split off without copying its bytes:
    `hidden` (or the field's name) is the WireTensor, other fields read the message."""

    __slots__ = ("field", "message", "tensor")

    def __init__(self, message: Message, field: str, tensor: WireTensor | None) -> None:
        self.message, self.field, self.tensor = message, field, tensor

    def __getattr__(self, name: str):
        if name == self.field:
            return self.tensor
        return getattr(self.message, name)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise DecodeError("truncated varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(view: memoryview):
    """(field number, wire type, start of the field, start of its payload, end) in order."""
    pos = 0
    while pos < len(view):
        start = pos
        key, pos = _read_varint(view, pos)
        number, kind = key >> 3, key & 7
        body = pos
        if kind == 0:
            _, pos = _read_varint(view, pos)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        elif kind == _LEN:
            size, body = _read_varint(view, pos)
            pos = body + size
        else:
            raise DecodeError(f"unsupported wire type {kind}")
        if pos > len(view) or number == 0:
            raise DecodeError("truncated message" if number else "field number 0")
        yield number, kind, start, body, pos


def _tensor(view: memoryview) -> WireTensor:
    dtype, shape, data = 0, [], memoryview(b"")
    for number, kind, _, body, end in _fields(view):
        if number == _DTYPE and kind == 0:
            dtype = _read_varint(view, body)[0]
        elif number == _SHAPE and kind == 0:
            shape.append(_signed(_read_varint(view, body)[0]))
        elif number == _SHAPE and kind == _LEN:  # packed
            pos = body
            while pos < end:
                value, pos = _read_varint(view, pos)
                shape.append(_signed(value))
        elif number == _DATA and kind == _LEN:
            data = view[body:end]
    return WireTensor(dtype, tuple(shape), data)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def framed_parser(cls: type[Message], field: str) -> Callable[[bytes], Framed]:
    """A gRPC deserializer for `cls` that leaves tensor field `field` in the received
    bytes (a view, not a copy): the rest is parsed by protobuf as usual."""
    number = cls.DESCRIPTOR.fields_by_name[field].number

    def parse(data: bytes) -> Framed:
        view = memoryview(data)
        rest, tensor = [], None
        for got, kind, start, body, end in _fields(view):
            if got != number:
                rest.append(view[start:end])
            elif kind != _LEN or tensor is not None:
                raise DecodeError(f"field {field} must appear once, as a message")
            else:
                tensor = _tensor(view[body:end])
        return Framed(cls.FromString(b"".join(rest)), field, tensor)

    return parse


def serialize(message: Message | bytes) -> bytes:
    """gRPC request/response serializer that passes pre-framed bytes through."""
    return message if isinstance(message, bytes) else message.SerializeToString()
