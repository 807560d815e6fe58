"""Hypothesis strategies for fuzzing the wire contract: any protobuf message built from its
descriptor, one-field mutations of a valid message, raw garbage bytes, and domain-aware
ForwardRequests and GenerateRequests that get past the first checks of the servicers."""

from __future__ import annotations

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from common.proto_gen import wedlm_pb2 as pb

F = FieldDescriptor
U64_MAX = 2**64 - 1
HIDDEN = 64  # hidden_size of the tiny test checkpoints


def _mostly(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """Three draws in four from `usual` (hypothesis picks one_of branches uniformly)."""
    return st.one_of(usual, usual, usual, rare)


# ---- scalars: edge values first, then the whole range -----------------------------------
I32 = st.one_of(
    st.integers(-3, 70), st.sampled_from([-(2**31), 2**31 - 1]), st.integers(-(2**31), 2**31 - 1)
)
I64 = st.one_of(
    st.integers(-3, 600), st.sampled_from([-(2**63), 2**63 - 1]), st.integers(-(2**63), 2**63 - 1)
)
U32 = st.one_of(st.integers(0, 70), st.just(2**32 - 1), st.integers(0, 2**32 - 1))
U64 = st.one_of(st.integers(0, 70), st.just(U64_MAX), st.integers(0, U64_MAX))
F64 = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 5e-324]),
    st.floats(allow_nan=True, allow_infinity=True),
)
TEXT = st.text(max_size=24)
BYTES = st.binary(max_size=48)
# Sequence ids away from the coordinator's own (a counter from 0, padding rows at 2^62 + ...),
# so that fuzzing the worker never touches the KV of the cluster's real sequences.
SEQ_ID = st.one_of(
    st.integers(1 << 32, (1 << 62) - 1),
    st.integers((1 << 62) + (1 << 32), U64_MAX),
)

_SCALARS: dict[int, st.SearchStrategy] = {
    F.TYPE_INT32: I32,
    F.TYPE_SINT32: I32,
    F.TYPE_SFIXED32: I32,
    F.TYPE_INT64: I64,
    F.TYPE_SINT64: I64,
    F.TYPE_SFIXED64: I64,
    F.TYPE_UINT32: U32,
    F.TYPE_FIXED32: U32,
    F.TYPE_UINT64: U64,
    F.TYPE_FIXED64: U64,
    F.TYPE_DOUBLE: F64,
    F.TYPE_FLOAT: st.floats(width=32),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: TEXT,
    F.TYPE_BYTES: BYTES,
    F.TYPE_ENUM: I32,  # proto3 enums are open: unknown numbers travel too
}


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def field_values(field: FieldDescriptor, depth: int = 2) -> st.SearchStrategy:
    """A random value of one field: a list for repeated fields, a message for messages."""
    if field.type == F.TYPE_MESSAGE:
        one = messages(field.message_type, depth - 1)
    else:
        one = _SCALARS[field.type]
    return st.lists(one, max_size=5) if _is_repeated(field) else one


def _assign(msg: Message, field: FieldDescriptor, value) -> None:
    name = field.name
    if _is_repeated(field):
        msg.ClearField(name)
        getattr(msg, name).extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(msg, name).CopyFrom(value)
    else:
        setattr(msg, name, value)


@st.composite
def _messages(draw: st.DrawFn, descriptor: Descriptor, depth: int) -> Message:
    msg = pb.__dict__[descriptor.name]()
    for field in descriptor.fields:
        if depth <= 0 and field.type == F.TYPE_MESSAGE:
            continue
        if draw(st.booleans()):  # each field set or left unset (oneofs: the last set wins)
            _assign(msg, field, draw(field_values(field, depth)))
    return msg


def messages(descriptor: Descriptor, depth: int = 2) -> st.SearchStrategy:
    """Any message of this type: every field random or absent, nested messages included."""
    return _messages(descriptor, depth)


@st.composite
def mutated(draw: st.DrawFn, valid: Message) -> Message:
    """A copy of `valid` with one field (maybe nested) cleared, replaced or grown."""
    msg = type(valid)()
    msg.CopyFrom(valid)
    target = msg
    while True:
        field = draw(st.sampled_from(list(target.DESCRIPTOR.fields)))
        nested = field.type == F.TYPE_MESSAGE and not _is_repeated(field)
        if nested and target.HasField(field.name) and draw(st.booleans()):
            target = getattr(target, field.name)  # mutate inside the submessage
            continue
        break
    action = draw(st.sampled_from(["clear", "replace", "append"]))
    if action == "clear":
        target.ClearField(field.name)
    elif action == "append" and _is_repeated(field):
        item = (
            messages(field.message_type) if field.type == F.TYPE_MESSAGE else _SCALARS[field.type]
        )
        getattr(target, field.name).extend(draw(st.lists(item, min_size=1, max_size=3)))
    else:
        _assign(target, field, draw(field_values(field)))
    return msg


def raw_requests(descriptor: Descriptor, valid: list[Message]) -> st.SearchStrategy[bytes]:
    """Bytes the server must deserialize: garbage, other messages' encodings, and valid
    encodings truncated, extended or with one byte flipped."""
    encodings = [m.SerializeToString() for m in valid] or [b""]

    @st.composite
    def damaged(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(st.sampled_from(encodings)))
        how = draw(st.sampled_from(["truncate", "extend", "flip"]))
        if how == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif how == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        else:
            data += draw(st.binary(min_size=1, max_size=16))
        return bytes(data)

    others = [d for d in pb.DESCRIPTOR.message_types_by_name.values() if d is not descriptor]
    return st.one_of(
        st.binary(max_size=64),
        damaged(),
        messages(descriptor).map(lambda m: m.SerializeToString()),
        st.sampled_from(others).flatmap(messages).map(lambda m: m.SerializeToString()),
        st.sampled_from(
            [b"\xff" * 10, b"\x0a\x05\xff\xfe\xfd\xfc\xfb", b"\x0a\xff\xff\xff\xff\x0f"]
        ),
    )


# ---- ForwardRequest --------------------------------------------------------------------
def hidden_tensor(shape: list[int], dtype: int, seed: int, specials: bool) -> pb.Tensor:
    """A well-formed hidden-state tensor (random normals, maybe with nan/inf sprinkled in)."""
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if specials:
        flat = values.reshape(-1)
        flat[:4] = [np.nan, np.inf, -np.inf, 3e38][: min(4, flat.size)]
    if dtype == pb.DTYPE_FLOAT16:
        with np.errstate(over="ignore"):  # 3e38 becomes inf, as intended
            data = values.astype(np.float16).tobytes()
    elif dtype == pb.DTYPE_BFLOAT16:
        data = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        data = values.tobytes()
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


WIRE_DTYPES = st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16])


def new_rows(
    seq_ids: list[int],
    t: int,
    widths: list[int],
    keeps: list[int],
    dtype: int,
    seed: int,
    plan_epoch: int = 0,
) -> pb.ForwardRequest:
    """A valid first forward of new sequences (committed 0) under plan `plan_epoch`."""
    b = len(seq_ids)
    filled = np.zeros((b, t), np.uint8)
    for row, w in enumerate(widths):
        filled[row, :w] = 1
    return pb.ForwardRequest(
        seq_ids=seq_ids,
        committed=[0] * b,
        widths=widths,
        keep=keeps,
        filled=filled.tobytes(),
        positions=[0] * b,
        hidden=hidden_tensor([b, t, HIDDEN], dtype, seed, specials=False),
        plan_epoch=plan_epoch,
    )


@st.composite
def forward_requests(draw: st.DrawFn) -> pb.ForwardRequest:
    """Every field either consistent with the others (most of the time) or random, so that
    the checks after the first one are reached too."""
    b = draw(_mostly(st.integers(1, 3), st.just(0)))
    t = draw(_mostly(st.integers(1, 8), st.sampled_from([511, 512, 513, 4097, 1 << 20])))
    seq_ids = draw(
        _mostly(st.lists(SEQ_ID, min_size=b, max_size=b, unique=True), st.lists(SEQ_ID, max_size=4))
    )
    committed = draw(_mostly(st.just([0] * b), st.lists(I64, max_size=4)))
    positions = draw(_mostly(st.just(list(committed)), st.lists(I64, max_size=4)))
    widths = draw(
        _mostly(
            st.lists(st.integers(1, max(1, min(t, 8))), min_size=b, max_size=b),
            st.lists(I32, max_size=4),
        )
    )
    keeps_for = st.tuples(*(st.integers(0, w) if 0 <= w <= 8 else st.just(w) for w in widths))
    keep = draw(_mostly(keeps_for.map(list), st.lists(I32, max_size=4)))
    if b * t <= 4096:
        filled_rows = st.binary(min_size=b * t, max_size=b * t).map(
            lambda x: bytes(v & 1 for v in x)
        )
    else:
        filled_rows = st.just(b"\x01" * min(b * t, 1 << 20))
    filled = draw(_mostly(filled_rows, BYTES))
    small = b * t * HIDDEN <= 1 << 18
    hidden = draw(
        _mostly(
            st.builds(
                hidden_tensor,
                st.just([b, t, HIDDEN]) if small else st.just([b, 1, HIDDEN]),
                WIRE_DTYPES,
                st.integers(0, 2**32 - 1),
                st.booleans(),
            ),
            st.one_of(st.none(), messages(pb.Tensor.DESCRIPTOR)),
        )
    )
    msg = pb.ForwardRequest(
        batch_id=draw(U64),
        seq_ids=seq_ids,
        committed=committed,
        widths=widths,
        keep=keep,
        filled=filled,
        positions=positions,
    )
    if hidden is not None:
        msg.hidden.CopyFrom(hidden)
    if draw(st.booleans()):  # the selection the last worker gets: valid, or anything
        per_row = draw(_mostly(st.integers(0, t), st.integers(0, 2**32 - 1)))
        count = b * per_row if per_row <= 8 else 0
        slots = draw(
            _mostly(
                st.lists(st.integers(0, max(0, t - 1)), min_size=count, max_size=count),
                st.lists(I32, max_size=8),
            )
        )
        msg.reply_rows.per_row = per_row
        msg.reply_rows.slots.extend(slots)
    return msg


# ---- GenerateRequest -------------------------------------------------------------------
VALID_GENERATE = [
    pb.GenerateRequest(text="hello there", max_tokens=3),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), mode="ar", max_tokens=3),
    pb.GenerateRequest(
        text="count: one, two",
        chat=True,
        window=4,
        threshold=0.8,
        penalty=0.1,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        max_tokens=4,
        stop_ids=[9],
        stop=["x"],
        seed=3,
        deadline_s=30.0,
    ),
    pb.GenerateRequest(text="one by one", one_by_one=True, window=2, max_tokens=3),
]


# (plausible, wild) values of each GenerateRequest field; None leaves an optional unset.
_PROMPTS = (
    st.one_of(
        st.text(min_size=1, max_size=40).map(lambda t: ("text", t)),
        st.lists(st.integers(0, 319), min_size=1, max_size=20).map(lambda ids: ("ids", ids)),
    ),
    st.one_of(
        st.just(("none", None)),
        TEXT.map(lambda t: ("text", t)),
        st.integers(0, 1000).map(lambda n: ("text", "word " * n)),  # past the context of 512
        st.lists(I32, max_size=8).map(lambda ids: ("ids", ids)),
        st.integers(400, 600).map(lambda n: ("ids", [7] * n)),
    ),
)
_GENERATE_FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "chat": (st.booleans(), st.booleans()),
    "mode": (st.sampled_from(["", "wedlm", "ar"]), TEXT),
    "window": (st.none() | st.integers(1, 16), I32),
    "threshold": (st.none() | st.floats(0.05, 3.0), F64),
    "one_by_one": (st.just(False), st.just(True)),
    "penalty": (st.none() | st.floats(0.0, 1.0), F64),
    "temperature": (st.floats(0.0, 2.0), F64),
    "top_p": (st.none() | st.floats(0.01, 1.0), F64),
    "top_k": (st.integers(0, 400), I32),
    "max_tokens": (st.integers(1, 6), st.none() | I32),
    "stop_ids": (st.lists(st.integers(0, 319), max_size=3), st.lists(I32, max_size=3)),
    "stop": (st.lists(st.text(min_size=1, max_size=5), max_size=2), st.lists(TEXT, max_size=3)),
    "seed": (U32, U32),
    "deadline_s": (st.sampled_from([0.0, 30.0]), st.one_of(st.just(1e-9), F64)),
}


@st.composite
def generate_requests(draw: st.DrawFn, max_wild: int = 2) -> pb.GenerateRequest:
    """Plausible requests with up to `max_wild` fields wild (none: a request to accept)."""
    wild = draw(st.sets(st.sampled_from(["prompt", *_GENERATE_FIELDS]), max_size=max_wild))
    msg = pb.GenerateRequest()
    kind, prompt = draw(_PROMPTS["prompt" in wild])
    if kind == "text":
        msg.text = prompt
    elif kind == "ids":
        msg.token_ids.ids.extend(prompt)
    for name, choices in _GENERATE_FIELDS.items():
        value = draw(choices[name in wild])
        if name == "chat" and kind == "ids" and name not in wild:
            value = False  # chat applies to text prompts only
        if name == "one_by_one" and msg.HasField("threshold") and name not in wild:
            value = False  # the two are exclusive
        if isinstance(value, list):
            getattr(msg, name).extend(value)
        elif value is not None:
            setattr(msg, name, value)
    return msg
