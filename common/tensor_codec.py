"""MLX arrays ⇄ wire tensors: dtype enum, shape and raw bytes. bfloat16 travels as its raw
16-bit words (viewed as uint16), never through float16 or pickle."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.proto_gen import wedlm_pb2 as pb
from common.wire_frames import TensorFrame, WireTensor

_TO_WIRE = {
    mx.float32: (pb.DTYPE_FLOAT32, np.float32, None),
    mx.float16: (pb.DTYPE_FLOAT16, np.float16, None),
    mx.bfloat16: (pb.DTYPE_BFLOAT16, np.uint16, mx.uint16),
}
_FROM_WIRE = {
    wire: (mx_dtype, np_dtype, view) for mx_dtype, (wire, np_dtype, view) in _TO_WIRE.items()
}
MAX_ELEMENTS = 1 << 31


class TensorFormatError(ValueError):
    """A wire tensor whose dtype, shape or byte count is inconsistent."""


def wire_form(array: mx.array) -> tuple[int, mx.array]:
    """The wire dtype and the (lazy) array whose bytes travel. Evaluating it together with
    the computation that produces `array` saves encode() a second evaluation."""
    if array.dtype not in _TO_WIRE:
        raise TensorFormatError(f"cannot send dtype {array.dtype}")
    wire, _, view = _TO_WIRE[array.dtype]
    return wire, (array.view(view) if view is not None else array)


def encode(array: mx.array) -> pb.Tensor:
    """A wire tensor message (the Forward path frames its tensors by hand instead)."""
    wire, raw = wire_form(array)
    data = memoryview(np.ascontiguousarray(np.array(raw, copy=False))).tobytes()
    return pb.Tensor(dtype=wire, shape=list(raw.shape), data=data)


def frame(wire: int, raw: mx.array) -> TensorFrame:
    """A tensor for a message framed by hand, from wire_form()'s output (evaluated here if
    it is not yet): the bytes are read from the array's own buffer when the message is
    put together, with no intermediate copies."""
    return TensorFrame.of_array(wire, np.array(raw, copy=False))


def encode_frame(array: mx.array) -> TensorFrame:
    return frame(*wire_form(array))


def wire_dtype(wire: int) -> mx.Dtype:
    """The MLX dtype of a wire dtype enum."""
    if wire not in _FROM_WIRE:
        raise TensorFormatError(f"unknown tensor dtype {wire}")
    return _FROM_WIRE[wire][0]


def decode(tensor: pb.Tensor | WireTensor) -> mx.array:
    if tensor.dtype not in _FROM_WIRE:
        raise TensorFormatError(f"unknown tensor dtype {tensor.dtype}")
    mx_dtype, np_dtype, view = _FROM_WIRE[tensor.dtype]
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise TensorFormatError(f"negative dimension in shape {shape}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count > MAX_ELEMENTS:
        raise TensorFormatError(f"tensor of shape {shape} is too large")
    itemsize = np.dtype(np_dtype).itemsize
    data = tensor.data  # each access to a bytes field copies it: read it once
    if len(data) != count * itemsize:
        raise TensorFormatError(
            f"tensor of shape {shape} and dtype {mx_dtype} needs {count * itemsize} bytes, "
            f"got {len(data)}"
        )
    host = np.frombuffer(data, dtype=np_dtype).reshape(shape)
    array = mx.array(host)
    return array.view(mx_dtype) if view is not None else array
