"""Hand-framed Forward messages are byte-compatible with the generated protobuf classes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from google.protobuf.message import DecodeError

from common.proto_gen import wedlm_pb2 as pb
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, encode, encode_frame
from common.wire_frames import TensorFrame, framed_parser, serialize, with_bytes, with_tensor
from coordinator.cluster.worker_chain import forward_request

SHAPES = [(1, 3, 8), (2, 16, 64), (0, 1, 8), (1, 70_000, 1)]  # 70,000: a 3-byte length


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_framed_reply_parses_to_the_protobuf_message(dtype, shape):
    x = mx.random.normal(shape, key=mx.random.key(1)).astype(dtype)
    header = pb.ForwardReply(batch_id=7, compute_s=0.5, queue_s=0.25)
    framed = with_tensor(header, "hidden", encode_frame(x))
    built = pb.ForwardReply(batch_id=7, compute_s=0.5, queue_s=0.25, hidden=encode(x))
    parsed = pb.ForwardReply.FromString(framed)
    assert parsed == built
    assert mx.array_equal(decode(parsed.hidden), x)
    assert decode(parsed.hidden).dtype == dtype


def _spec(b: int, t: int) -> RowsSpec:
    filled = np.ones((b, t), bool)
    filled[:, -1] = False
    return RowsSpec(
        [11 + i for i in range(b)],
        np.arange(b, dtype=np.int64) * 5,
        np.full(b, t, np.int64),
        filled,
        np.full(b, t - 1, np.int64),
    )


def test_forward_request_from_an_array_and_relayed_from_a_reply():
    """What the coordinator sends to the first worker, and what it relays to the next one
    (re-framed from the parsed reply), parse to the same message as one built field by
    field."""
    spec = _spec(2, 4)
    x = mx.random.normal((2, 4, 16), key=mx.random.key(2)).astype(mx.bfloat16)
    want = pb.ForwardRequest(
        batch_id=3,
        seq_ids=spec.seq_ids,
        committed=spec.starts.tolist(),
        widths=spec.widths.tolist(),
        keep=spec.keeps.tolist(),
        filled=spec.filled.astype(np.uint8).tobytes(),
        positions=spec.starts.tolist(),
        hidden=encode(x),
    )
    first = pb.ForwardRequest.FromString(forward_request(3, spec, encode_frame(x)))
    reply = pb.ForwardReply.FromString(with_tensor(pb.ForwardReply(), "hidden", encode_frame(x)))
    relayed = pb.ForwardRequest.FromString(forward_request(3, spec, reply.hidden))
    assert first == want
    assert relayed == want


def test_a_frame_reads_the_array_buffer_it_is_given():
    data = np.arange(6, dtype=np.uint16).reshape(2, 3)
    frame = TensorFrame.of_array(pb.DTYPE_BFLOAT16, data)
    assert frame.data.nbytes == 12 and bytes(frame.data) == data.tobytes()


def test_serialize_passes_bytes_through_and_serializes_messages():
    msg = pb.ForwardReply(batch_id=5)
    assert serialize(b"\x08\x05") == b"\x08\x05"
    assert serialize(msg) == msg.SerializeToString()


def test_a_field_already_set_is_refused():
    with pytest.raises(ValueError, match="framed by hand"):
        with_tensor(pb.ForwardReply(hidden=pb.Tensor()), "hidden", encode_frame(mx.zeros((1,))))


@pytest.mark.parametrize("shape", SHAPES)
def test_framed_parser_splits_the_tensor_without_copying(shape):
    """The receive side: every other field as protobuf parses it, the tensor's bytes a view
    of the received buffer (no copy), decoding to the same array."""
    x = mx.random.normal(shape, key=mx.random.key(2)).astype(mx.bfloat16)
    reply = pb.ForwardReply(batch_id=9, compute_s=0.1, stage_compute_s=[0.1, 0.2])
    data = with_tensor(reply, "hidden", encode_frame(x))
    framed = framed_parser(pb.ForwardReply, "hidden")(data)
    assert framed.message == reply and framed.batch_id == 9  # fields read through
    assert isinstance(framed.hidden.data, memoryview) and framed.hidden.data.obj is data
    assert framed.hidden.shape == tuple(shape)
    assert mx.array_equal(decode(framed.hidden), x)
    request = pb.ForwardRequest.FromString(forward_request(3, _spec(2, 4), encode(x[:0])))
    request.reply_rows.per_row = 1
    request.reply_rows.slots.extend([0, 1])
    split = framed_parser(pb.ForwardRequest, "hidden")(request.SerializeToString())
    request.ClearField("hidden")
    assert split.message == request


def test_framed_parser_refuses_what_does_not_parse():
    parse = framed_parser(pb.ForwardRequest, "hidden")
    good = forward_request(1, _spec(1, 2), encode(mx.zeros((1, 2, 8))))
    with pytest.raises(DecodeError):
        parse(good[:-3])  # truncated
    with pytest.raises(DecodeError):
        again = with_tensor(pb.ForwardRequest(), "hidden", encode_frame(mx.zeros((1, 2, 8))))
        parse(good + again)  # the tensor field twice
    with pytest.raises(DecodeError):
        parse(b"\x07")  # wire type 7 does not exist
    assert parse(b"").tensor is None  # an empty message has no tensor: the servicer says so


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300_000])
def test_a_bytes_field_framed_by_hand_parses_as_protobuf_writes_it(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    framed = with_bytes(pb.LayerChunk(offset=7, sha256=""), "data", memoryview(data))
    assert pb.LayerChunk.FromString(framed) == pb.LayerChunk(offset=7, data=data)
    if size:  # byte for byte what protobuf writes (it leaves an empty field out)
        assert framed == pb.LayerChunk(offset=7, data=data).SerializeToString()
    with pytest.raises(ValueError, match="framed by hand"):
        with_bytes(pb.LayerChunk(data=b"x"), "data", data)
