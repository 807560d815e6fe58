"""OpenAI's Responses API at /v1/responses, driven by the official `openai` package
against one real coordinator process (the whole tiny model)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.cluster_harness import http_coordinator

KEY = "responses-key"
SYSTEM = "You answer briefly."
ITEMS = [
    {"role": "user", "content": "one, two, three"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "four, five"}]},
    {"role": "user", "content": [{"type": "input_text", "text": "The quick brown fox"}]},
]
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "one, two, three"},
    {"role": "assistant", "content": "four, five"},
    {"role": "user", "content": "The quick brown fox"},
]


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    model = checkpoint_dir("qwen2", seed=7)
    with http_coordinator(model, "--api-key", KEY) as coord:
        yield {"http": coord.http, "model": model.name}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["http"], api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def ask(client, server, **kw):
    args = {"model": server["model"], "instructions": SYSTEM, "input": ITEMS,
            "max_output_tokens": 10}  # fmt: skip
    return client.responses.create(**{**args, **kw})


def test_response_equals_the_chat_answer(server, client):
    answer = ask(client, server)
    chat = client.chat.completions.create(model=server["model"], messages=MESSAGES,
                                          max_tokens=10)  # fmt: skip
    text = chat.choices[0].message.content
    assert answer.object == "response" and answer.id.startswith("resp_")
    assert answer.output_text == text
    assert [i.type for i in answer.output] == ["message"]
    assert answer.output[0].content[0].type == "output_text"
    assert answer.output[0].content[0].text == text
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    length = chat.choices[0].finish_reason == "length"
    assert answer.status == ("incomplete" if length else "completed")
    if length:
        assert answer.incomplete_details.reason == "max_output_tokens"
    plain = client.responses.create(model=server["model"], input="The quick brown fox",
                                    max_output_tokens=1, temperature=0.7, top_p=0.9)  # fmt: skip
    assert plain.status == "incomplete" and plain.usage.output_tokens == 1


def test_streamed_events(server, client):
    whole = ask(client, server, max_output_tokens=16)
    events = list(ask(client, server, max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{whole.status}"
    assert "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_refusals(server, client):
    for kw, field in [({"store": True}, "store"),
                      ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
                      ({"previous_response_id": "resp_1"}, "previous_response_id"),
                      ({"max_output_tokens": 100_000}, "max_output_tokens")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, server, **kw)
        assert err.value.body["param"] == field, err.value.body
    assert "maximum context length is 512" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        ask(client, server, model="gpt-nothing")
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, server, input=image)
    assert "'input_image'" in err.value.body["message"]
    nokey = httpx.post(f"{server['http']}/responses", json={"model": server["model"],
                                                             "input": "hi"})  # fmt: skip
    assert nokey.status_code == 401
