"""Serialized Forward messages with their hidden states framed by hand.

Setting and serializing a large nested bytes field through the protobuf runtime copies the
payload several times (a message copy on assignment, then growing serialization buffers):
for a 4 MiB tensor that cost more than the gRPC transfer itself. Here the small fields go
through protobuf as usual and the tensor field is appended as raw wire bytes, so the payload
is copied once. The result is byte-for-byte a valid message of the generated class: the
receiver parses it with the ordinary `FromString`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from google.protobuf.message import Message

from common.proto_gen import wedlm_pb2 as pb

_LEN = 2  # protobuf wire type of bytes and nested messages
_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number


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


def serialize(message: Message | bytes) -> bytes:
    """gRPC request/response serializer that passes pre-framed bytes through."""
    return message if isinstance(message, bytes) else message.SerializeToString()
