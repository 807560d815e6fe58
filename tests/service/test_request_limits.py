"""Prompts bounded before tokenizing (common/prompt_limit.py through Tokenizer.encode), the
body limit's reading of the headers, and the --max-request-bytes flag. The refusals as
clients see them: test_request_limits_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import PromptTooLong
from common.prompt_limit import PIECE_CHARS, pieces
from common.tokenizer import Tokenizer
from coordinator.http_api.body_limit import _content_length
from coordinator.service.server_cli import build_parser, serve_options

TEXT = "Once upon a time there was a little robot who liked to count: one, two, three.\n"


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3", seed=36)


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer(model)


def test_pieces_cut_before_spaces_and_rejoin():
    text = TEXT * 1000
    parts = list(pieces(text))
    assert "".join(parts) == text and len(parts) > 1
    assert all(p.startswith(" ") for p in parts[1:])
    assert all(len(p) <= PIECE_CHARS for p in parts)
    solid = "x" * (3 * PIECE_CHARS + 5)  # no space to cut at: cut anywhere
    assert [len(p) for p in pieces(solid)] == [PIECE_CHARS] * 3 + [5]


def test_a_prompt_that_fits_is_tokenized_as_before(tokenizer):
    long = TEXT * 300  # longer than a piece: counted by pieces, then tokenized whole
    assert len(long) > PIECE_CHARS
    for text in (TEXT, long):
        assert tokenizer.encode(text, limit=len(long)) == tokenizer.encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": long}]
    direct = tokenizer._hf.apply_chat_template(messages, add_generation_prompt=True)
    ids = direct["input_ids"] if hasattr(direct, "keys") else direct
    assert tokenizer.encode_chat(messages, limit=len(long)) == list(ids)


def test_too_long_prompts_are_refused_without_tokenizing_them_whole(tokenizer, monkeypatch):
    context = 512
    longest = tokenizer.longest_token_chars
    counted: list[int] = []
    count = tokenizer._count
    monkeypatch.setattr(
        tokenizer, "_count", lambda piece: counted.append(len(piece)) or count(piece)
    )
    too_many = "y" * (context * longest + 1)
    bound = f"{len(too_many):,} characters, more than this model's context of 512 tokens can"
    with pytest.raises(PromptTooLong, match=bound):
        tokenizer.encode(too_many, limit=context)
    with pytest.raises(PromptTooLong, match=bound):
        tokenizer.encode_chat([{"role": "user", "content": too_many}], context)
    assert not counted  # refused by length alone
    context = 8192
    text = TEXT * 1000  # tens of thousands of tokens, under the length bound
    assert len(text) < context * longest
    with pytest.raises(PromptTooLong, match=r"more than 8,192 tokens, this model's context \("):
        tokenizer.encode(text, limit=context)
    assert len(counted) == 1  # the first piece passed the context: the rest never tokenized
    short = TEXT * 10  # under a piece: tokenized whole, then its count checked
    n = len(tokenizer.encode(short))
    with pytest.raises(PromptTooLong, match=f"the prompt has {n} tokens, more than"):
        tokenizer.encode(short, limit=n - 1)


@pytest.mark.parametrize("command", ["serve", "local"])
def test_max_request_bytes_flag(model, command):
    args = build_parser().parse_args([command, "--model", str(model)])
    assert serve_options(args, model=model).max_request_bytes is None  # from the context
    args = build_parser().parse_args(
        [command, "--model", str(model), "--max-request-bytes", "65536"]
    )
    assert serve_options(args, model=model).max_request_bytes == 65536


def test_declared_length_trusted_only_without_transfer_encoding():
    """A body framed as chunked despite a small Content-Length is counted, not trusted."""
    length = (b"content-length", b"12")
    assert _content_length({"headers": [length]}) == 12
    assert _content_length({"headers": [length, (b"transfer-encoding", b"chunked")]}) is None
    assert _content_length({"headers": [(b"content-length", b"x")]}) is None
    assert _content_length({"headers": []}) is None
