"""The OpenAI fields beyond text, through the `openai` package against a real coordinator:
logprobs / top_logprobs (chat and completions, streamed and not), structured output
(response_format json_object / json_schema), and their validation."""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import ollama
import openai
import pytest

from common.tokenizer import Tokenizer
from tests.support.checkpoints import TOOL_CHAT_TEMPLATE
from tests.support.cluster_harness import http_coordinator

QUESTION = [{"role": "user", "content": "what is the weather in Paris"}]
MODES = ["ar", "wedlm", "speculative"]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir(
        "qwen2", seed=5, chat_template=TOOL_CHAT_TEMPLATE, max_position_embeddings=2048
    )


@pytest.fixture(scope="module")
def server(model):
    with http_coordinator(model) as coord:
        yield {"http": coord.http, "model": model.name}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["http"], api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _chat(client, server, **kw):
    return client.chat.completions.create(model=server["model"], messages=QUESTION, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_chat_logprobs_streamed_equal_whole(server, client, mode):
    args = {"max_tokens": 12, "logprobs": True, "top_logprobs": 3, "extra_body": {"mode": mode}}
    whole = _chat(client, server, **args)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert text == whole.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert e.top_logprobs[0].token == e.token  # greedy: the likeliest
        assert bytes(e.bytes).decode("utf-8", "backslashreplace") == e.token
    streamed = []
    for chunk in _chat(client, server, stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_completion_logprobs(server, client):
    args = {"model": server["model"], "prompt": "once upon a time", "max_tokens": 8,
            "logprobs": 2, "extra_body": {"mode": "ar"}}  # fmt: skip
    whole = client.completions.create(**args)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **args)
                if c.choices and c.choices[0].logprobs]  # fmt: skip
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    values = [v for s in streamed for v in s.token_logprobs]
    assert values == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert all(math.isfinite(v) for v in values)


def test_no_logprobs_unless_asked(server, client):
    plain = _chat(client, server, max_tokens=4, extra_body={"mode": "ar"})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"extra_body": {"logprobs": 3}}, "logprobs"),
    ],
)
def test_bad_logprob_fields_are_400(server, client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, server, max_tokens=2, **kw)
    assert err.value.body["param"] == param


def test_bad_completion_logprobs_are_400(server, client):
    for value in (21, -1):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=server["model"], prompt="hi", logprobs=value)
        assert err.value.body["param"] == "logprobs"


# ---- structured output ---------------------------------------------------------------

# Bounded strings and numbers: a random model's answer ends within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "maxItems": 3},
    },
    "required": ["name", "age", "member", "color", "scores"],
    "additionalProperties": False,
}  # fmt: skip
WORDS = ["cat", "sky", "river", "piano", "seven", "orange", "cloud", "table", "quiet", "north"]


@pytest.mark.parametrize("mode", MODES)
def test_json_schema_output_validates(server, client, mode):
    rng = random.Random(mode)
    prompts = [" ".join(rng.choices(WORDS, k=5)) for _ in range(20)]
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def ask(prompt: str, temperature: float):
        return client.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": prompt}],
            response_format=response_format, max_tokens=200, temperature=temperature,
            seed=1, extra_body={"mode": mode},
        )  # fmt: skip

    with ThreadPoolExecutor(8) as pool:  # concurrent: constrained rows share forwards
        answers = list(pool.map(ask, prompts, [0.0, 1.0] * 10))
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
        assert answer.usage.mode == mode  # constrained output keeps its decoding mode
    if mode == "speculative":  # greedy: the constrained answer is AR's
        ar = ask(prompts[0], 0.0)
        assert ar.choices[0].message.content == answers[0].choices[0].message.content


def test_json_object_is_an_object(server, client):
    answer = client.chat.completions.create(
        model=server["model"], messages=QUESTION, response_format={"type": "json_object"},
        max_tokens=30, extra_body={"mode": "ar"})  # fmt: skip
    text = answer.choices[0].message.content
    assert text.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    stream = client.chat.completions.create(
        model=server["model"], messages=QUESTION, response_format={"type": "json_object"},
        max_tokens=30, extra_body={"mode": "ar"}, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "x"}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
         "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_bad_response_formats_are_400(server, client, response_format, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, server, max_tokens=2, response_format=response_format)
    assert err.value.body["param"] == param


def test_ollama_format_and_responses_text_format(server, client):
    """Ollama's `format` and the Responses API's `text.format` are the same grammar."""
    ollama_client = ollama.Client(host=server["http"].removesuffix("/v1"))
    for fmt in ("json", SCHEMA):
        answer = ollama_client.chat(model=server["model"], messages=QUESTION, format=fmt,
                                    options={"num_predict": 200, "temperature": 0})  # fmt: skip
        text = answer.message.content
        assert text.startswith("{")
        if fmt is SCHEMA:
            jsonschema.validate(json.loads(text), SCHEMA)
    response = client.responses.create(
        model=server["model"], input="describe a person", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}})  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"


# ---- penalties, logit_bias, seed ------------------------------------------------------


def _tokens(client, server, **kw) -> list[str]:
    """The answer's tokens (as completions' logprobs spell them)."""
    answer = client.completions.create(model=server["model"], prompt="the cat sat on the",
                                       max_tokens=24, logprobs=0, **kw)  # fmt: skip
    return answer.choices[0].logprobs.tokens


@pytest.mark.parametrize("mode", MODES)
def test_logit_bias_forces_and_bans(server, client, model, mode):
    tok = Tokenizer(model)
    ids = {tok.token_bytes(i).decode("utf-8", "backslashreplace"): i
           for i in range(len(tok.vocabulary()))}  # fmt: skip
    forced = tok.encode(" blue")[-1]
    piece = tok.token_bytes(forced).decode("utf-8", "backslashreplace")
    text = _tokens(client, server, logit_bias={str(forced): 100}, extra_body={"mode": mode})
    assert set(text) == {piece}
    free = _tokens(client, server, extra_body={"mode": mode})
    banned = _tokens(client, server, logit_bias={str(ids[free[0]]): -100},
                     extra_body={"mode": mode})  # fmt: skip
    assert free[0] not in banned


def test_penalties_stop_repeating(server, client):
    """A random greedy model repeats itself; penalties make it choose other tokens."""
    plain = _tokens(client, server, extra_body={"mode": "ar"})
    assert len(set(plain)) < len(plain)
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
               {"extra_body": {"repetition_penalty": 5.0}}):  # fmt: skip
        kw.setdefault("extra_body", {})["mode"] = "wedlm"  # penalized requests decode AR
        penalized = _tokens(client, server, **kw)
        assert len(set(penalized)) > len(set(plain)), kw


def test_seed_reproduces_sampled_output(server, client):
    def sample(seed: int, mode: str) -> str:
        return _chat(client, server, max_tokens=16, temperature=1.0, seed=seed,
                     extra_body={"mode": mode}).choices[0].message.content  # fmt: skip

    for mode in MODES:
        assert sample(11, mode) == sample(11, mode)
        assert len({sample(s, mode) for s in (1, 2, 3)}) > 1


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"cat": 1}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ],
)
def test_bad_penalties_are_400(server, client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, server, max_tokens=2, **kw)
    assert err.value.body["param"] == param


# ---- n choices -----------------------------------------------------------------------


def test_n_choices_are_independent_sequences(server, client):
    args = {"max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 3, "extra_body": {"mode": "ar"}}
    whole = _chat(client, server, **args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1  # seeds 5, 6, 7
    single = _chat(client, server, max_tokens=10, temperature=1.0, seed=5,
                   extra_body={"mode": "ar"})  # fmt: skip
    assert single.choices[0].message.content == texts[0]
    assert whole.usage.completion_tokens == sum(
        _chat(client, server, max_tokens=10, temperature=1.0, seed=s,
              extra_body={"mode": "ar"}).usage.completion_tokens for s in (5, 6, 7))  # fmt: skip
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    streamed = {0: "", 1: "", 2: ""}
    finished, usage = set(), None
    for chunk in _chat(client, server, stream=True, stream_options={"include_usage": True},
                       **args):  # fmt: skip
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert usage.completion_tokens == whole.usage.completion_tokens
    text = client.completions.create(model=server["model"], prompt="once", n=2, max_tokens=6,
                                     temperature=1.0, seed=3)  # fmt: skip
    assert [c.index for c in text.choices] == [0, 1]


def test_anthropic_tool_choice_any_and_tool(server):
    import anthropic

    tool = {"name": "get_time", "description": "the time now", "input_schema": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}  # fmt: skip
    client = anthropic.Anthropic(base_url=server["http"].removesuffix("/v1"), api_key="x")
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        message = client.messages.create(model=server["model"], max_tokens=120, tools=[tool],
                                         tool_choice=choice, messages=QUESTION)  # fmt: skip
        assert message.stop_reason == "tool_use"
        use = next(b for b in message.content if b.type == "tool_use")
        assert use.name == "get_time"
        jsonschema.validate(use.input, tool["input_schema"])


def test_ollama_logprobs(server):
    client = ollama.Client(host=server["http"].removesuffix("/v1"))
    args = {"model": server["model"], "messages": QUESTION, "logprobs": True,
            "top_logprobs": 2, "options": {"num_predict": 8, "temperature": 0}}  # fmt: skip
    whole = client.chat(stream=False, **args)
    assert len(whole.logprobs) == whole.eval_count
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in whole.logprobs)
    streamed = [e for part in client.chat(stream=True, **args) for e in part.logprobs or ()]
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs]
    generated = client.generate(model=server["model"], prompt="once upon", raw=True,
                                logprobs=True, options={"num_predict": 4})  # fmt: skip
    assert len(generated.logprobs) == 4
