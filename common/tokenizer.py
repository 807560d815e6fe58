"""Tokenizer, chat template and streaming detokenization, through transformers and mlx-lm."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import prompt_limit
from common.errors import CheckpointError


@dataclass(frozen=True)
class ToolSyntax:
    """How a model writes a tool call: mlx-lm's markers and parser for its template."""

    start: str  # e.g. "<tool_call>"
    end: str  # e.g. "</tool_call>"
    parse: Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools)
    format: str = ""  # mlx-lm's tool_parser_type (json_tools, qwen3_coder, ...) or "harmony"
    # the added tokens (text, id), special or not: a grammar names a marker that is one
    # by its id, since llguidance does not match an added token's text
    added_tokens: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ReplySyntax:
    """How a model's chat answer is laid out, read from its checkpoint: its tool calls
    (None: it makes none), its reasoning markers (mlx-lm's think_start/think_end), and
    whether it speaks OpenAI's harmony (gpt-oss: channels instead of markers)."""

    tools: ToolSyntax | None
    think: tuple[str, str] | None
    harmony: bool


# gpt-oss's harmony control tokens; a template that writes these is harmony.
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>",
                   "<|end|>", "<|call|>", "<|return|>")  # fmt: skip


# Instruct models end turns with these even when config.json names another EOS.
_CHAT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")
_HARMONY_ENDS = ("<|return|>", "<|call|>")


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from mlx_lm.utils import _tokenizer_defaults
        from transformers.utils import logging as hf_logging

        # transformers warns that it does not know model_type "wedlm"; the tokenizer is fine.
        hf_logging.set_verbosity_error()

        path = Path(path)
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer.model").exists():
            raise CheckpointError(f"no tokenizer (tokenizer.json or tokenizer.model) in {path}")
        try:
            # defaults: a model module's TOKENIZER_DEFAULTS (its parser, template), as
            # mlx_lm.load passes them
            self._wrapper = load_tokenizer(path, defaults=_tokenizer_defaults(path))
        except Exception as e:  # transformers raises many types for broken files
            raise CheckpointError(f"cannot load the tokenizer in {path}: {e}") from None
        self._hf = self._wrapper._tokenizer
        _keep_leading_space(self._wrapper)
        vocab = self._hf.get_vocab()
        self.reply = self._reply_syntax()
        # harmony ends a turn with <|return|> (the answer) or <|call|> (a tool call: the
        # parser reads a call cut there), as gpt-oss's generation_config says
        ends = _CHAT_STOP_TOKENS + (_HARMONY_ENDS if self.reply.harmony else ())
        self.stop_ids = tuple(sorted({vocab[t] for t in ends if t in vocab}))
        # Special tokens (EOS, chat markers) stay in token lists but not in displayed text,
        # except the reply's own markers (harmony's channels, a special <think>): the
        # answer's parser reads them; a stop token is still left out.
        markers = {*HARMONY_MARKERS} if self.reply.harmony else set()
        markers |= {*(self.reply.think or ())}
        if self.reply.tools is not None:
            markers |= {self.reply.tools.start, self.reply.tools.end}
        kept = {vocab[m] for m in markers if m in vocab} - set(self.stop_ids)
        # (every added token marked special, as the fast tokenizer's decode skips them)
        special = {i for i, t in self._hf.added_tokens_decoder.items() if t.special}
        self.special_ids = frozenset({*self._hf.all_special_ids, *special} - kept)
        # The most characters one token stands for (a byte-level vocabulary spells a token
        # with one character per byte: still a bound), so that a text that cannot fit a
        # context is known from its length alone.
        self.longest_token_chars = max(map(len, vocab), default=1)
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

        self._byte_level = isinstance(self._wrapper._detokenizer, BPEStreamingDetokenizer)

    def vocabulary(self) -> dict[str, int]:
        """Token string → id, special tokens included."""
        return self._hf.get_vocab()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def encode(self, text: str, chat: bool = False, limit: int | None = None) -> list[int]:
        """`limit`: the model's context; a text that cannot fit it raises PromptTooLong
        without being tokenized whole."""
        if chat:
            return self.encode_chat([{"role": "user", "content": text}], limit)
        return self._encode(text, True, limit)

    def encode_chat(
        self, messages: list[dict[str, Any]], limit: int | None = None, tools: list | None = None
    ) -> list[int]:
        """A conversation through the model's chat template, ready for the assistant.
        `tools`: OpenAI function definitions, rendered by the template where it can."""
        if not self.has_chat_template:
            raise CheckpointError("this model's tokenizer has no chat template (drop --chat)")
        if limit is not None:  # before rendering: the template copies every message
            chars = sum(len(m.get("content") or "") for m in messages)
            chars += sum(len(json.dumps(m["tool_calls"])) for m in messages if m.get("tool_calls"))
            chars += len(json.dumps(tools)) if tools else 0
            prompt_limit.check_chars(chars, limit, self.longest_token_chars)
        # What apply_chat_template(tokenize=True) does, in two steps so that the rendered
        # text is checked before it is tokenized.
        text = self._hf.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
        return self._encode(text, False, limit)

    @property
    def tool_calling(self) -> ToolSyntax | None:
        """How this model writes a tool call (mlx-lm's markers and parser, chosen from the
        chat template, or harmony's), or None when its template has no tool calling."""
        return self.reply.tools

    def _reply_syntax(self) -> ReplySyntax:
        w = self._wrapper
        template = getattr(self._hf, "chat_template", None)
        harmony = isinstance(template, str) and all(
            m in template for m in ("<|channel|>", "<|message|>")
        )
        tools = None
        added = tuple((t.content, i) for i, t in sorted(self._hf.added_tokens_decoder.items()))
        if harmony:  # mlx-lm has no harmony parser: ours
            from common.harmony import TOOL_START, parse_tool_call

            tools = ToolSyntax(TOOL_START, "<|call|>", parse_tool_call, "harmony", added)
        elif w.has_tool_calling and w.tool_parser is not None:
            kind = self._hf.init_kwargs.get("tool_parser_type", "")
            tools = ToolSyntax(w.tool_call_start, w.tool_call_end, w.tool_parser, kind, added)
        think = (w.think_start, w.think_end) if w.has_thinking and not harmony else None
        return ReplySyntax(tools, think, harmony)

    def starts_in_reasoning(self, prompt: list[int]) -> bool:
        """The prompt opens a reasoning block it does not close (GLM-4.7's and Qwen3's
        templates end with `<think>`): the answer begins as reasoning (mlx-lm's server's
        rule)."""
        if self.reply.think is None:
            return False
        w = self._wrapper
        return w.rfind_think_start(prompt) > w.rfind_think_end(prompt)

    def _encode(self, text: str, special: bool, limit: int | None) -> list[int]:
        if limit is not None:
            prompt_limit.check_chars(len(text), limit, self.longest_token_chars)
            if len(text) > prompt_limit.PIECE_CHARS:
                prompt_limit.check_count(text, limit, self._count)
        ids = [int(i) for i in self._hf.encode(text, add_special_tokens=special)]
        if limit is not None:
            prompt_limit.check_tokens(len(ids), limit)
        return ids

    def _count(self, piece: str) -> int:
        return len(self._hf.encode(piece, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=False)

    def text(self, ids: list[int]) -> str:
        """What a user reads: the completion without special tokens (the reply's markers
        kept, as the stream keeps them)."""
        return self._hf.decode([i for i in ids if i not in self.special_ids])

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer underneath (llguidance reads its vocabulary)."""
        return self._hf

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may be part of a character:
        its own decode would be U+FFFD)."""
        piece = self._hf.convert_ids_to_tokens(int(token_id))
        if self._byte_level and piece is not None and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        return self.decode([int(token_id)]).encode()

    def detokenizer(self) -> TextStream:
        """A fresh streaming detokenizer for one sequence (mlx-lm hands out a reset copy)."""
        return TextStream(self._wrapper.detokenizer, self.special_ids)


class TextStream:
    """mlx-lm's streaming detokenizer, skipping special tokens: `add(ids)` returns the
    newly printable text, `finish()` whatever was held back."""

    def __init__(self, detok, special_ids: frozenset[int]) -> None:
        self._detok = detok
        self._special = special_ids

    def add(self, ids: list[int]) -> str:
        for t in ids:
            if t not in self._special:
                self._detok.add_token(t)
        return self._detok.last_segment

    def finish(self) -> str:
        self._detok.finalize()
        return self._detok.last_segment


def _keep_leading_space(wrapper) -> None:
    """Make the streamed text equal `decode(ids)`, the whole answer's text.

    mlx-lm's byte-level BPE stream drops the completion's first space (what a SentencePiece
    decoder's Strip step does), but a byte-level decoder keeps it: `decode(ids)` of
    " Paris." is " Paris.", so the stream must be too. SentencePiece streams already agree
    (they trim exactly where that decoder strips), and the naive stream decodes."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    class ByteLevelStream(BPEStreamingDetokenizer):
        def __init__(self, tokenmap: list[str]) -> None:  # mlx-lm's map, not rebuilt
            self.tokenmap = tokenmap
            self.reset()

        def _maybe_trim_space(self, current_text: str) -> str:
            return current_text

    detok = wrapper._detokenizer
    if type(detok) is BPEStreamingDetokenizer:
        wrapper._detokenizer = ByteLevelStream(detok.tokenmap)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte (mlx-lm's table)."""
    from mlx_lm.tokenizer_utils import _byte_decoder as table

    return dict(table())


_BYTE_DECODER = _byte_decoder()
