"""Prompts that cannot fit the model's context are refused without tokenizing them whole:
a text longer than the context could hold at the vocabulary's longest token is refused
from its length alone, and a long text is counted piece by piece, stopping as soon as
the count passes the context (a 200 MB prompt would otherwise become millions of token
ids, and minutes of CPU, before the context check)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from common.errors import PromptTooLong

PIECE_CHARS = 16_384  # characters tokenized at a time while counting a long text
# A cut between pieces can change the tokens around it by a few; the exact count
# of a text that passed comes from tokenizing it whole.
SLACK_PER_PIECE = 4


def check_chars(chars: int, context: int, longest_token: int) -> None:
    if chars > context * longest_token:
        raise PromptTooLong(
            f"the prompt is {chars:,} characters, more than this model's context of "
            f"{context:,} tokens can hold ({context * longest_token:,} characters at "
            f"{longest_token} per token at most)"
        )


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters, cut before a space where one is near,
    where the tokenizer's own pre-tokenization would cut too."""
    start = 0
    while start < len(text):
        end = start + size
        if end < len(text):
            space = text.rfind(" ", start + size // 2, end)
            end = space if space > start else end
        yield text[start:end]
        start = end


def check_count(text: str, context: int, count: Callable[[str], int]) -> None:
    """Count `text`'s tokens piece by piece; refuse once the count passes the context
    (with the slack the cuts allow)."""
    tokens = done = 0
    for n, piece in enumerate(pieces(text), 1):
        tokens += count(piece)
        done += len(piece)
        if tokens > context + SLACK_PER_PIECE * n:
            raise PromptTooLong(
                f"the prompt has more than {context:,} tokens, this model's context "
                f"({tokens:,} in its first {done:,} of {len(text):,} characters)"
            )


def check_tokens(tokens: int, context: int, what: str = "tokens") -> None:
    if tokens > context:
        raise PromptTooLong(
            f"the prompt has {tokens:,} {what}, more than this model's context of "
            f"{context:,} tokens"
        )
