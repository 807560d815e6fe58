"""Ollama's API at /api/*, driven by the official `ollama` package against one real
coordinator process (the whole tiny model)."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from coordinator.http_api.ollama_app import ChatRequest, chat_to_openai
from tests.support.cluster_harness import http_coordinator

KEY = "ollama-key"
SYSTEM = "You answer briefly."
TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "one, two, three"},
    {"role": "assistant", "content": "four, five"},
    {"role": "user", "content": "The quick brown fox"},
]
GREEDY = {"temperature": 0, "num_predict": 10}


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    model = checkpoint_dir("qwen2", seed=7)
    with http_coordinator(model, "--api-key", KEY) as coord:
        yield {"http": coord.http, "root": coord.root, "model": model.name}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server["root"], headers={"Authorization": f"Bearer {KEY}"},
                         timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def oa(server):
    with openai.OpenAI(base_url=server["http"], api_key=KEY, max_retries=0) as c:
        yield c


def test_chat_equals_the_openai_chat_answer(server, client, oa):
    answer = client.chat(model=server["model"], messages=TURNS, options=GREEDY, stream=False)
    chat = oa.chat.completions.create(model=server["model"], messages=TURNS, max_tokens=10)
    assert answer.message.role == "assistant"
    assert answer.message.content == chat.choices[0].message.content
    assert answer.done is True and answer.done_reason == chat.choices[0].finish_reason
    assert answer.prompt_eval_count == chat.usage.prompt_tokens
    assert answer.eval_count == chat.usage.completion_tokens
    assert answer.model == server["model"] and answer.created_at.endswith("Z")
    for field in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(answer, field), int) and getattr(answer, field) >= 0
    tagged = client.chat(model=f"{server['model']}:latest", messages=TURNS, options=GREEDY,
                         stream=False)  # fmt: skip
    assert tagged.message.content == answer.message.content
    assert tagged.model == f"{server['model']}:latest"
    short = client.chat(model=server["model"], messages=TURNS, stream=False,
                        options={"num_predict": 1, "temperature": 0.7, "top_p": 0.9,
                                 "top_k": 20, "seed": 3})  # fmt: skip
    assert short.done_reason == "length" and short.eval_count == 1


def test_chat_stream_and_stop(server, client):
    whole = client.chat(model=server["model"], messages=TURNS, stream=False,
                        options={"temperature": 0, "num_predict": 16})  # fmt: skip
    parts = list(client.chat(model=server["model"], messages=TURNS, stream=True,
                             options={"temperature": 0, "num_predict": 16}))  # fmt: skip
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    last = parts[-1]
    assert last.message.content == "" and last.done_reason == whole.done_reason
    assert (last.eval_count, last.prompt_eval_count) == (whole.eval_count,
                                                         whole.prompt_eval_count)  # fmt: skip
    text = whole.message.content
    stop = text.strip()[2:4]
    assert len(stop) == 2 and "\ufffd" not in stop, text
    cut = client.chat(model=server["model"], messages=TURNS, stream=False,
                      options={"temperature": 0, "num_predict": 16, "stop": [stop]})  # fmt: skip
    assert cut.done_reason == "stop" and cut.message.content == text[: text.index(stop)]


def test_stream_is_ndjson(server):
    body = {"model": server["model"], "messages": TURNS[1:], "options": {"num_predict": 3}}
    with httpx.stream("POST", f"{server['root']}/api/chat", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as answer:  # fmt: skip
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in answer.iter_lines() if line]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] in ("stop", "length") and lines[-1]["eval_count"] <= 3


def test_generate_templated_and_raw(server, client, oa):
    prompt = "The quick brown fox"
    templated = client.generate(model=server["model"], prompt=prompt, system=SYSTEM,
                                options=GREEDY)  # fmt: skip
    chat = oa.chat.completions.create(model=server["model"], max_tokens=10, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}])  # fmt: skip
    assert templated.response == chat.choices[0].message.content and templated.done
    assert templated.prompt_eval_count == chat.usage.prompt_tokens
    raw = client.generate(model=server["model"], prompt=prompt, raw=True, options=GREEDY)
    text = oa.completions.create(model=server["model"], prompt=prompt, max_tokens=10)
    assert raw.response == text.choices[0].text
    assert raw.prompt_eval_count == text.usage.prompt_tokens
    streamed = list(client.generate(model=server["model"], prompt=prompt, raw=True,
                                    options=GREEDY, stream=True))  # fmt: skip
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    loaded = client.generate(model=server["model"])  # what clients send to load a model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_list_show_version(server, client):
    models = client.list().models
    assert [m.model for m in models] == [server["model"]]
    assert models[0].details.family == "qwen2"
    shown = client.show(server["model"])
    assert "completion" in shown.capabilities
    assert shown.modelinfo["qwen2.context_length"] == 512
    assert shown.details.family == "qwen2"
    version = httpx.get(f"{server['root']}/api/version").json()["version"]
    assert version.count(".") == 2
    apis = httpx.get(f"{server['http']}/models", headers={"Authorization": f"Bearer {KEY}"})
    assert "/api/chat" in apis.json()["data"][0]["apis"]["ollama"]["path"]


def test_errors_in_ollama_shape(server, client):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama3:latest", messages=TURNS)
    assert err.value.status_code == 404 and "llama3" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama3")
    assert err.value.status_code == 404
    wrong = ollama.Client(host=server["root"], headers={"Authorization": "Bearer nope"})
    with pytest.raises(ollama.ResponseError) as err:
        wrong.list()
    assert err.value.status_code == 401
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=server["model"], messages=TURNS, options={"num_predict": 100_000},
                    stream=False)  # fmt: skip
    assert err.value.status_code == 400
    assert "maximum context length is 512 tokens" in err.value.error
    assert "options.num_predict" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=server["model"], messages=TURNS, format={"type": "nonsense"},
                    stream=False)  # fmt: skip
    assert err.value.status_code == 400 and "format" in err.value.error
    image = [{"role": "user", "content": "what is this?", "images": ["aGVsbG8="]}]
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=server["model"], messages=image, stream=False)
    assert err.value.status_code == 400 and "images" in err.value.error
    headers = {"Authorization": f"Bearer {KEY}"}
    bad = httpx.post(f"{server['root']}/api/chat", headers=headers, content=b"{nope")
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    bad = httpx.post(f"{server['root']}/api/chat", headers=headers,
                     json={"model": server["model"], "messages": [{"role": "robot"}]})  # fmt: skip
    assert bad.status_code == 400 and "messages[0].role" in bad.json()["error"]


def test_tool_calls_become_openai_messages():
    body = ChatRequest.model_validate({
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        ],
        "options": {"num_predict": -1, "stop": "x"},
    })  # fmt: skip
    chat = chat_to_openai(body)
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1].tool_calls[0].function.arguments == {"city": "Paris"}
    assert chat.tools_in_use() and chat.max_tokens is None and chat.stop == "x"
