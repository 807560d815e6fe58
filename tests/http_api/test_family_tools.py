"""Each family's answer format, on fixed strings: the parser is chosen from the checkpoint's
chat template (mlx-lm's inference for GLM-4.7 and Qwen3-Coder, harmony for gpt-oss), the
answer splits into content, reasoning and tool calls the same whole and streamed one
character at a time, and `tool_choice`'s grammar in each format accepts exactly the
family's own call markup (llguidance over the checkpoint's tokenizer)."""

from __future__ import annotations

import json

import pytest

from common.harmony import HarmonyStream, parse_tool_call
from common.tokenizer import Tokenizer
from coordinator.engine.constrained import Grammars
from coordinator.http_api.reply_parsing import Reasoning, ReplyStream, split_reply
from coordinator.http_api.response_format import tool_choice_grammar
from coordinator.http_api.tool_grammar import call_lark
from tests.support.checkpoints import TOOL_CHAT_TEMPLATE, make_checkpoint, make_mlx_checkpoint
from tests.support.family_chat_templates import GLM47, GPT_OSS, MINIMAX_M2, QWEN3_CODER
from tests.support.family_tool_checkpoints import (
    GLM_PLAIN,
    GLM_SPECIAL,
    HARMONY_SPECIAL,
    MINIMAX_PLAIN,
    MINIMAX_SPECIAL,
    _add_tokens,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}  # fmt: skip
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, Tokenizer]:
    """A checkpoint's tokenizer per template (GLM's and gpt-oss's with their marker tokens)."""
    out = {}
    for name, family, template, added in (
        ("glm", "glm4", GLM47, (GLM_SPECIAL, GLM_PLAIN)),
        ("harmony", "gpt_oss", GPT_OSS, (HARMONY_SPECIAL, [])),
        ("coder", "qwen3_moe", QWEN3_CODER, None),
        ("minimax", "minimax", MINIMAX_M2, (MINIMAX_SPECIAL, MINIMAX_PLAIN)),
    ):
        folder = tmp_path_factory.mktemp(name)
        make = make_checkpoint if family == "qwen3_moe" else make_mlx_checkpoint
        make(folder, family, chat_template=template, vocab_size=352)
        if added:
            _add_tokens(folder, *added)
        out[name] = Tokenizer(folder)
    return out


def _streamed(syntax, text: str, tools, in_reasoning: bool = False):
    """split_reply's answer, from a stream fed one character at a time."""
    stream = ReplyStream(syntax, tools, in_reasoning)
    pieces = [p for ch in text for p in stream.add(ch)] + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str) and not isinstance(p, Reasoning))
    reasoning = "".join(p for p in pieces if isinstance(p, Reasoning))
    return content, reasoning, [c for p in pieces if isinstance(p, list) for c in p]


def _plain(calls):
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            for c in calls]  # fmt: skip


def test_the_format_is_read_from_the_checkpoint(toks):
    glm, harmony, coder = toks["glm"].reply, toks["harmony"].reply, toks["coder"].reply
    assert (glm.tools.format, glm.think, glm.harmony) == ("glm47", ("<think>", "</think>"), False)
    assert (harmony.tools.format, harmony.think, harmony.harmony) == ("harmony", None, True)
    assert (coder.tools.format, coder.harmony) == ("qwen3_coder", False)
    assert toks["minimax"].reply.tools.format == "minimax_m2"
    # GLM-4.7's generation prompt opens <think>: its answer starts as reasoning
    prompt = toks["glm"].encode_chat([{"role": "user", "content": "hi"}])
    assert toks["glm"].starts_in_reasoning(prompt)
    # harmony's control tokens are special, yet kept in the text its parser reads
    ids = toks["harmony"].encode("<|channel|>final<|message|>hi<|end|>")
    assert toks["harmony"].text(ids) == "<|channel|>final<|message|>hi<|end|>"
    vocab = toks["harmony"].vocabulary()  # and a turn ends at <|return|> or <|call|>
    assert {vocab["<|return|>"], vocab["<|call|>"]} <= set(toks["harmony"].stop_ids)


@pytest.mark.parametrize(
    "name, text, in_reasoning, expected",
    [
        ("glm", "The user asks.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key>"
         "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
         "</tool_call>", True, ("Checking.", "The user asks.", [PARIS])),
        # a call straight from reasoning (mlx-lm's server allows it)
        ("glm", "Hm<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>", True, ("", "Hm", [PARIS])),
        ("minimax", "Think.\n</think>\n\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
         "<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">2</parameter>\n"
         "</invoke>\n</minimax:tool_call>", True, ("\n\n", "Think.\n", [PARIS])),
        ("coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
         "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", False,
         ("Sure.\n", "", [PARIS])),
        ("harmony", "<|channel|>analysis<|message|>Weather asked.<|end|><|start|>assistant"
         '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
         '{"city": "Paris", "days": 2}<|call|>', False, ("", "Weather asked.", [PARIS])),
        # the recipient before the channel, as gpt-oss's template renders a past call
        ("harmony", ' to=functions.get_weather<|channel|>commentary json<|message|>'
         '{"city": "Paris", "days": 2}', False, ("", "", [PARIS])),
        ("harmony", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>"
         "final<|message|>It is sunny.<|return|>", False, ("It is sunny.", "Easy.", [])),
        # a model that ignores harmony: its text is the answer
        ("harmony", "just text, no channels", False, ("just text, no channels", "", [])),
    ],
)  # fmt: skip
def test_answers_split_whole_and_streamed(toks, name, text, in_reasoning, expected):
    syntax = toks[name].reply
    content, reasoning, calls = split_reply(syntax, text, [WEATHER], in_reasoning)
    assert (content, reasoning, _plain(calls)) == expected
    content, reasoning, calls = _streamed(syntax, text, [WEATHER], in_reasoning)
    assert (content, reasoning, _plain(calls)) == expected


def test_without_tools_calls_stay_text(toks):
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    content, reasoning, calls = split_reply(toks["glm"].reply, "a</think>" + text, None, True)
    assert (content, reasoning, calls) == (text, "a", [])


def test_harmony_pieces():
    call = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}'
    assert parse_tool_call(call) == {"name": "f", "arguments": {"a": 1}}
    with pytest.raises(ValueError):
        parse_tool_call("<|channel|>final<|message|>hi")
    stream = HarmonyStream()  # a held-back end marker that never completes is text
    assert stream.add("<|channel|>final<|message|>Hi<|ret") == [("content", "Hi")]
    assert stream.finish() == [("content", "<|ret")]


@pytest.mark.parametrize(
    "name, call",
    [
        ("glm", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"),
        ("coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"),
        ("minimax", "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">"
         "Paris</parameter>\n<parameter name=\"days\">2</parameter>\n</invoke>\n"
         "</minimax:tool_call>"),
        ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
         '{"city":"Paris","days":2}<|call|>'),
    ],
)  # fmt: skip
def test_tool_choice_grammar_writes_the_family_markup(toks, name, call):
    tok = toks[name]
    grammars = Grammars(tok, 352, tok.stop_ids)
    grammar = call_lark([WEATHER], tok.reply.tools, tok.stop_ids)
    grammars.check(grammar)
    matcher = grammars.matcher(grammar)
    ids = tok.encode(call)
    if ids[-1] in tok.stop_ids:  # harmony's <|call|> ends the turn: the stop, not the grammar
        ids = ids[:-1]
    assert matcher.validate_tokens(ids) == len(ids)  # the family's own call is accepted
    matcher.consume_tokens(ids)
    assert matcher.is_accepting()
    assert _plain(split_reply(tok.reply, call, [WEATHER])[2]) == [PARIS]
    # and nothing else: another function's name is refused at its first token
    other = tok.encode(call.replace("get_weather", "get_time"))
    assert grammars.matcher(grammar).validate_tokens(other) < len(other)


def test_json_tools_grammar_names_added_markers(tmp_path):
    """Qwen's <tool_call> is an added token in its real tokenizer: tool_choice required
    names it by id (llguidance matches no added token's text)."""
    folder = make_checkpoint(tmp_path, "qwen2", chat_template=TOOL_CHAT_TEMPLATE, vocab_size=352)
    _add_tokens(folder, [], ["<tool_call>", "</tool_call>"])
    tok = Tokenizer(folder)
    grammars = Grammars(tok, 352, tok.stop_ids)
    grammar = tool_choice_grammar("required", [WEATHER], tok.reply.tools, grammars)
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":2}}\n</tool_call>'
    ids = tok.encode(call)
    assert ids[0] == tok.vocabulary()["<tool_call>"]
    matcher = grammars.matcher(grammar)
    assert matcher.validate_tokens(ids) == len(ids)
    matcher.consume_tokens(ids)
    assert matcher.is_accepting()
