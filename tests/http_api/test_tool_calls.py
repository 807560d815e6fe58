"""OpenAI tool calls: tools and tool results rendered by the checkpoint's own chat template
(Qwen2.5's, with `<tool_call>`), the model's call text parsed by mlx-lm's parser into
`tool_calls` (whole and streamed), and requests with tools through the `openai` package
against a real coordinator (a random model writes no call: its answer stays text)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from common.tokenizer import Tokenizer
from coordinator.http_api.api_errors import ApiError
from coordinator.http_api.request_mapping import chat_prompt
from coordinator.http_api.schemas import ChatCompletionRequest
from coordinator.http_api.tool_calls import ToolCallStream, split_tool_calls
from tests.support.checkpoints import TOOL_CHAT_TEMPLATE
from tests.support.cluster_harness import http_coordinator

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}
QUESTION = {"role": "user", "content": "what is the weather in Paris"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}  # fmt: skip
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir(
        "qwen2", seed=5, chat_template=TOOL_CHAT_TEMPLATE, max_position_embeddings=2048
    )


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer(model)


def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **kw})


def test_tools_and_results_rendered_by_the_template(tok):
    syntax = tok.tool_calling
    assert (syntax.start, syntax.end) == ("<tool_call>", "</tool_call>")  # mlx-lm's json_tools
    body = _body(messages=[QUESTION, CALLED, RESULT], tools=[WEATHER])
    text = tok.decode(chat_prompt(body, tok, 2048))
    assert '"name": "get_weather"' in text and "The weather in a city now" in text
    assert '"properties": {"city": {"type": "string"}}' in text  # the schema
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool_choice "none": the tools are not rendered
    plain = tok.decode(chat_prompt(_body(messages=[QUESTION], tools=[WEATHER],
                                         tool_choice="none"), tok, 2048))  # fmt: skip
    assert "get_weather" not in plain and "<tools>" not in plain


def test_bad_tool_arguments_and_unsupported_choices(tok):
    bad = {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "{city"}}]}  # fmt: skip
    with pytest.raises(ApiError) as err:
        chat_prompt(_body(messages=[QUESTION, bad, RESULT], tools=[WEATHER]), tok, 2048)
    assert err.value.param == "messages[1].tool_calls[0].function.arguments"
    field, why = _body(messages=[QUESTION], tool_choice="required").unsupported()
    assert field == "tool_choice" and "no tools" in why


ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')  # fmt: skip


def test_whole_answer_split_into_text_and_calls(tok):
    text, calls = split_tool_calls(tok.tool_calling, ANSWER, [WEATHER])
    assert text == "Let me check. "
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["id"] != calls[1]["id"]
    # no call, a malformed call, an unterminated one (the answer hit its limit)
    assert split_tool_calls(tok.tool_calling, "just text <tool", None) == ("just text <tool", [])
    assert split_tool_calls(tok.tool_calling, "a<tool_call>{oops</tool_call>b", None) == (
        "a<tool_call>{oops</tool_call>b", [])  # fmt: skip
    text, calls = split_tool_calls(tok.tool_calling, 'x<tool_call>{"name": "f", "arguments": {}}')
    assert text == "x" and calls[0]["function"] == {"name": "f", "arguments": "{}"}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_answer_split_chunk_by_chunk(tok, size):
    stream = ToolCallStream(tok.tool_calling, [WEATHER])
    pieces = []
    for i in range(0, len(ANSWER), size):
        out = stream.add(ANSWER[i : i + size])
        assert not any(isinstance(p, str) and "<" in p for p in out)  # markers never leak
        pieces += out
    pieces += stream.finish()
    text = "".join(p for p in pieces if isinstance(p, str))
    calls = [c for p in pieces if isinstance(p, list) for c in p]
    assert text == "Let me check. " and stream.calls == 2
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


# ---- against a real coordinator -------------------------------------------------------


@pytest.fixture(scope="module")
def server(model):
    with http_coordinator(model) as coord:
        yield {"http": coord.http, "model": model.name}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["http"], api_key="x", max_retries=0, timeout=60) as c:
        yield c


def test_requests_with_tools_answer(server, client):
    args = {"model": server["model"], "tools": [WEATHER], "max_tokens": 8,
            "extra_body": {"mode": "ar"}}  # fmt: skip
    first = client.chat.completions.create(messages=[QUESTION], **args)
    choice = first.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert isinstance(choice.message.content, str)
    plain = client.chat.completions.create(model=server["model"], messages=[QUESTION],
                                           max_tokens=8, extra_body={"mode": "ar"})  # fmt: skip
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' schema
    # the second turn: the call and its result
    second = client.chat.completions.create(messages=[QUESTION, CALLED, RESULT], **args)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        messages=[QUESTION, CALLED, RESULT], stream=True, **args))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == second.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == second.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError) as err:  # no such tool
        client.chat.completions.create(messages=[QUESTION], **args,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})  # fmt: skip
    assert err.value.body["param"] == "tool_choice"


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
WEATHER_SCHEMA = {**WEATHER["function"]["parameters"], "additionalProperties": False,
                  "properties": {"city": {"type": "string", "maxLength": 6}}}  # fmt: skip
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"],
                                                   "parameters": WEATHER_SCHEMA}}  # fmt: skip


@pytest.mark.parametrize("mode", ["ar", "wedlm"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_required_and_named_tool_choice_make_a_random_model_call(
    server, client, mode, stream, choice
):
    """The grammar makes even a random model write a call that parses and validates."""
    tool_choice = choice if choice == "required" else {
        "type": "function", "function": {"name": choice}}  # fmt: skip
    args = {"model": server["model"], "messages": [QUESTION], "tools": [STRICT_WEATHER, TIME],
            "tool_choice": tool_choice, "max_tokens": 200,
            "extra_body": {"mode": mode}}  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))
        calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or ()]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    else:
        answer = client.chat.completions.create(**args)
        calls, finish = answer.choices[0].message.tool_calls, answer.choices[0].finish_reason
        assert answer.usage.mode == mode  # constrained output keeps its decoding mode
    assert finish == "tool_calls" and len(calls) == 1
    name, arguments = calls[0].function.name, json.loads(calls[0].function.arguments)
    schemas = {"get_weather": WEATHER_SCHEMA, "get_time": TIME["function"]["parameters"]}
    if choice != "required":
        assert name == choice
    jsonschema.validate(arguments, schemas[name])
