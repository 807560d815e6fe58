"""/v1/completions' echo (the prompt, and with logprobs the prompt's logprobs, as lm-eval
scores loglikelihoods), lists of prompts in one request, and vLLM's /tokenize and
/detokenize, through the `openai` package and httpx against a real coordinator. The
prompt logprobs are checked against transformers' own forward of the same checkpoint."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.tokenizer import Tokenizer
from tests.support.checkpoints import TOOL_CHAT_TEMPLATE
from tests.support.cluster_harness import (
    cluster_name,
    http_coordinator,
    start_coordinator,
    start_worker,
)

K = 3
PROMPTS = ["the cat sat on the mat and looked", "one two three four", "a"]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir(
        "qwen2",
        seed=7,
        chat_template=TOOL_CHAT_TEMPLATE,
        max_position_embeddings=1024,
        num_hidden_layers=4,
    )


@pytest.fixture(scope="module")
def server(model):
    with http_coordinator(model) as coord:
        yield {"http": coord.http, "root": coord.http.removesuffix("/v1"), "model": model.name}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["http"], api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(model):
    return Tokenizer(model)


@pytest.fixture(scope="module")
def reference(model):
    """prompt ids -> [len - 1, V] log-softmax of transformers' logits (row n: token n + 1)."""
    net = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = net(torch.tensor([ids])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def cluster(model):
    """The coordinator holding layers 0-1, a worker the last ones (it returns the hidden
    states the coordinator's head reads)."""
    name, procs = cluster_name(), []
    try:
        worker, address = start_worker(model, name, "--layers", "2-3", "--no-bonjour")
        procs.append(worker)
        coord, _ = start_coordinator(
            model, name, "--no-bonjour", "--worker", address, "--expect", "1",
            "--layers", "0-1", "--http-port", "0",
        )  # fmt: skip
        procs.append(coord)
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        coord.expect("serving")
        yield {"http": http, "model": model.name}
    finally:
        for p in procs:
            p.stop()


def _complete(client, server, **kw):
    return client.completions.create(model=server["model"], **kw)


@pytest.mark.parametrize("max_tokens", [0, 4])
@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_logprobs_equal_transformers(client, server, tokenizer, reference, max_tokens, as_ids):
    text = PROMPTS[0]
    ids = tokenizer.encode(text)
    answer = _complete(
        client, server, prompt=ids if as_ids else text, max_tokens=max_tokens, echo=True,
        logprobs=K, extra_body={"mode": "ar"},
    )  # fmt: skip
    choice = answer.choices[0]
    lp = choice.logprobs
    echoed = text if not as_ids else tokenizer.decode(ids)
    assert choice.text.startswith(echoed)
    assert len(lp.tokens) == len(ids) + max_tokens == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(ids)
    for n in range(1, len(ids)):
        assert lp.token_logprobs[n] == pytest.approx(float(ref[n - 1, ids[n]]), abs=1e-4)
        top = torch.topk(ref[n - 1], K)
        strings = [tokenizer.token_bytes(int(t)).decode("utf-8", "backslashreplace")
                   for t in top.indices]  # fmt: skip
        assert list(lp.top_logprobs[n]) == strings
        assert list(lp.top_logprobs[n].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    usage = answer.usage
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert choice.text == echoed and choice.finish_reason == "length"
        return
    plain = _complete(client, server, prompt=text, max_tokens=max_tokens, logprobs=K,
                      extra_body={"mode": "ar"})  # fmt: skip
    assert choice.text == echoed + plain.choices[0].text
    assert lp.tokens[len(ids) :] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[len(ids) :] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-5
    )
    assert lp.text_offset[len(ids)] == len(echoed)


def test_echo_logprobs_are_computed_again_not_cached(client, server):
    args = {"prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 1}
    first, again = _complete(client, server, **args), _complete(client, server, **args)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs


def test_echo_without_logprobs_and_streamed(client, server):
    args = {"prompt": PROMPTS[1], "max_tokens": 5, "echo": True, "extra_body": {"mode": "ar"}}
    whole = _complete(client, server, **args)
    plain = _complete(client, server, prompt=PROMPTS[1], max_tokens=5, extra_body={"mode": "ar"})
    assert whole.choices[0].text == PROMPTS[1] + plain.choices[0].text
    assert whole.choices[0].logprobs is None
    for logprobs in (None, 2):
        chunks = list(_complete(client, server, stream=True, logprobs=logprobs, **args))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        if logprobs:
            listed = _complete(client, server, logprobs=logprobs, **args).choices[0].logprobs
            parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            assert [t for p in parts for t in p.tokens] == listed.tokens
            assert [o for p in parts for o in p.text_offset] == listed.text_offset
            assert [v for p in parts for v in p.token_logprobs] == listed.token_logprobs


def test_echo_only_streamed(client, server, tokenizer):
    args = {"prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 1}
    whole = _complete(client, server, **args)
    chunks = list(_complete(client, server, stream=True, stream_options={"include_usage": True},
                            **args))  # fmt: skip
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == PROMPTS[0] == whole.choices[0].text
    assert parts[-1].finish_reason == "length"
    tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens
    assert len(tokens) == len(tokenizer.encode(PROMPTS[0]))
    assert chunks[-1].usage.completion_tokens == 0


def test_a_list_of_prompts_answers_each_as_alone(client, server, tokenizer):
    args = {"max_tokens": 6, "extra_body": {"mode": "ar"}}
    alone = [_complete(client, server, prompt=p, **args) for p in PROMPTS]
    for prompt in (PROMPTS, [tokenizer.encode(p) for p in PROMPTS]):
        together = _complete(client, server, prompt=prompt, **args)
        assert [c.index for c in together.choices] == [0, 1, 2]
        assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
        assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed: dict[int, str] = {}
    chunks = list(_complete(client, server, prompt=PROMPTS, stream=True,
                            stream_options={"include_usage": True}, **args))  # fmt: skip
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}
    assert chunks[-1].usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_a_list_of_prompts_with_n_and_echo(client, server, tokenizer):
    args = {"max_tokens": 3, "temperature": 0.9, "seed": 11, "n": 2, "extra_body": {"mode": "ar"}}
    alone = [_complete(client, server, prompt=p, **args) for p in PROMPTS[:2]]
    together = _complete(client, server, prompt=PROMPTS[:2], **args)
    assert [c.index for c in together.choices] == [0, 1, 2, 3]  # prompt-major, as OpenAI
    assert [c.text for c in together.choices] == [c.text for a in alone for c in a.choices]
    echoed = _complete(client, server, prompt=PROMPTS[:2], echo=True, logprobs=1, **args)
    for i, c in enumerate(echoed.choices):
        prompt = PROMPTS[i // 2]
        assert c.text == prompt + together.choices[i].text
        count = len(tokenizer.encode(prompt))
        first = echoed.choices[i - i % 2].logprobs.token_logprobs[:count]
        assert c.logprobs.token_logprobs[:count] == first  # every choice: its prompt's
        assert c.logprobs.token_logprobs[0] is None
        assert count < len(c.logprobs.tokens) <= count + 3  # a choice may stop early


BAD = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": ["x", ""]}, "prompt[1]"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),
    ({"prompt": [[1, 10**7]]}, "prompt"),
    ({"prompt": ["x"] * 65, "n": 2}, "prompt"),
    ({"prompt": "x", "echo": True, "logprobs": 1, "n": 2, "stream": True}, "n"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completions_are_400_naming_the_field(server, fields, param):
    body = {"model": server["model"], **fields}
    reply = httpx.post(f"{server['http']}/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split("[")[0] in error["message"]


def test_chat_refuses_echo(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": "hi"}],
            extra_body={"echo": True},
        )  # fmt: skip
    assert err.value.body["param"] == "echo" and "/v1/completions" in err.value.body["message"]


def test_tokenize_round_trip(server, tokenizer):
    root = server["root"]
    text = "tokenize me, then give me back"
    got = httpx.post(f"{root}/tokenize", json={"model": server["model"], "prompt": text}).json()
    assert got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 1024
    back = httpx.post(f"{root}/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(got["tokens"])}
    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(f"{root}/tokenize", json={"messages": messages, "return_token_strs": True})
    expected = tokenizer.encode_chat(messages)
    assert chat.json()["tokens"] == expected and len(chat.json()["token_strs"]) == len(expected)
    with openai.OpenAI(base_url=server["http"], api_key="x", max_retries=0) as client:
        answer = client.chat.completions.create(
            model=server["model"], messages=messages, max_tokens=1
        )
    assert answer.usage.prompt_tokens == len(expected)  # what chat decodes from


TOKENIZE_BAD = [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "y"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": [1, -4]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), TOKENIZE_BAD)
def test_tokenize_refusals_are_400(server, path, body, param):
    reply = httpx.post(f"{server['root']}{path}", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    wrong = httpx.post(f"{server['root']}/tokenize", json={"model": "other", "prompt": "x"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_echo_logprobs_through_a_worker(cluster, tokenizer, reference):
    """Scored prompt rows come back from the last worker (every slot of the forward) in a
    batch of prompts of several lengths."""
    with openai.OpenAI(base_url=cluster["http"], api_key="x", max_retries=0, timeout=60) as c:
        answer = c.completions.create(
            model=cluster["model"], prompt=PROMPTS, max_tokens=2, echo=True, logprobs=K,
            extra_body={"mode": "ar"},
        )  # fmt: skip
    for prompt, choice in zip(PROMPTS, answer.choices, strict=True):
        ids = tokenizer.encode(prompt)
        ref = reference(ids)
        got = choice.logprobs.token_logprobs[1 : len(ids)]
        assert got == pytest.approx([float(ref[n - 1, ids[n]]) for n in range(1, len(ids))],
                                    abs=1e-4)  # fmt: skip
        assert choice.text.startswith(prompt)
