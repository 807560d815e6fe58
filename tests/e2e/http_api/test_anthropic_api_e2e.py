"""Anthropic's Messages API at /v1/messages, driven by the official `anthropic` package
against one real coordinator process (the whole tiny model)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from coordinator.http_api.anthropic_app import MessagesRequest, to_openai
from tests.support.cluster_harness import http_coordinator

KEY = "anthropic-key"
SYSTEM = "You answer briefly."
TURNS = [
    {"role": "user", "content": "one, two, three"},
    {"role": "assistant", "content": "four, five"},
    {"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]},
]


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    model = checkpoint_dir("qwen2", seed=7)
    with http_coordinator(model, "--api-key", KEY) as coord:
        yield {"http": coord.http, "root": coord.root, "model": model.name}


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server["root"], api_key=KEY, max_retries=0,
                             timeout=60) as c:  # fmt: skip
        yield c


def ask(client, server, **kw):
    args = {"model": server["model"], "system": SYSTEM, "messages": TURNS, "max_tokens": 10}
    return client.messages.create(**{**args, **kw})


def test_message_equals_the_openai_chat_answer(server, client):
    answer = ask(client, server)
    assert answer.type == "message" and answer.role == "assistant"
    assert answer.id.startswith("msg_") and answer.model == server["model"]
    assert [b.type for b in answer.content] == ["text"]
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.stop_sequence is None
    assert 1 <= answer.usage.output_tokens <= 10
    with openai.OpenAI(base_url=server["http"], api_key=KEY, max_retries=0) as oa:
        chat = oa.chat.completions.create(
            model=server["model"], max_tokens=10,
            messages=[{"role": "system", "content": SYSTEM}, *TURNS[:2],
                      {"role": "user", "content": "The quick brown fox"}],
        )  # fmt: skip
    assert answer.content[0].text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model=server["model"], system=SYSTEM, messages=TURNS)
    assert counted.input_tokens == answer.usage.input_tokens
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}  # not keyword arguments in 2.x
    short = ask(client, server, max_tokens=1, extra_body=sampling)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1


def test_stop_sequences_and_streaming(server, client):
    whole = ask(client, server, max_tokens=16)
    text = whole.content[0].text
    with client.messages.stream(model=server["model"], system=SYSTEM, messages=TURNS,
                                max_tokens=16) as stream:  # fmt: skip
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    stop = text.strip()[2:4]
    assert len(stop) == 2 and "\ufffd" not in stop, text
    cut = ask(client, server, max_tokens=16, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    with client.messages.stream(model=server["model"], system=SYSTEM, messages=TURNS,
                                max_tokens=16, stop_sequences=[stop]) as stream:  # fmt: skip
        assert "".join(stream.text_stream) == cut.content[0].text
        events = stream.get_final_message()
    assert events.stop_reason == "stop_sequence" and events.stop_sequence == stop


def test_stream_events_in_order(server):
    body = {"model": server["model"], "messages": TURNS, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server['http']}/messages", json=body,
                      headers={"x-api-key": KEY}) as answer:  # fmt: skip
        names = [line[7:] for line in answer.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}


def test_auth_and_errors_in_anthropic_shape(server, client):
    bearer = anthropic.Anthropic(base_url=server["root"], auth_token=KEY, max_retries=0)
    assert ask(bearer, server, max_tokens=1).usage.output_tokens == 1
    wrong = anthropic.Anthropic(base_url=server["root"], api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        ask(wrong, server)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as err:
        ask(client, server, model="claude-nothing")
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        ask(client, server, max_tokens=100_000)
    error = err.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert "maximum context length is 512 tokens" in error["message"]
    raw = httpx.post(f"{server['http']}/messages", headers={"x-api-key": KEY},
                     json={"model": server["model"], "messages": TURNS})  # fmt: skip
    assert raw.status_code == 400 and raw.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens is required"}}  # fmt: skip
    bad = httpx.post(f"{server['http']}/messages", headers={"x-api-key": KEY},
                     json={"model": server["model"], "max_tokens": 5, "stop_sequences": [""],
                           "messages": TURNS})  # fmt: skip
    assert bad.status_code == 400 and "stop_sequences" in bad.json()["error"]["message"]
    image = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
    with pytest.raises(anthropic.BadRequestError) as err:
        ask(client, server, messages=image)
    assert "'image'" in err.value.body["error"]["message"]


def test_tool_use_and_results_become_openai_messages():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ],
    })  # fmt: skip
    chat = to_openai(body, 5)
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool"]
    call = chat.messages[1].tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    assert chat.messages[2].tool_call_id == "toolu_1" and chat.messages[2].content == "sunny"
    assert chat.tools[0].function.parameters == {"type": "object"} and chat.tools_in_use()
