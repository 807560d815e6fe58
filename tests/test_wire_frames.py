"""Hand-framed Forward messages are byte-compatible with the generated protobuf classes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from common.proto_gen import wedlm_pb2 as pb
from common.rows_spec import RowsSpec
from common.tensor_codec import decode, encode, encode_frame
from common.wire_frames import TensorFrame, serialize, with_tensor
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
