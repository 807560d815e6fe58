"""HTTP API conventions clients rely on: streamed text equals the whole answer's (a leading
space, multi-byte characters and emoji included), OpenAI's words and code for a request
that does not fit the context (which litellm maps to ContextWindowExceededError), and CORS.
One coordinator process holding the whole tiny model."""

from __future__ import annotations

import httpx
import openai
import pytest

from common.tokenizer import Tokenizer
from coordinator.http_api.api_errors import CONTEXT_EXCEEDED, from_refusal
from coordinator.service.admission import INVALID, TOO_LARGE, Overflow, Refused
from tests.support.cluster_harness import http_coordinator

KEY = "conventions-key"
ORIGIN = "https://chat.example.com"


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("qwen2", seed=7)


@pytest.fixture(scope="module")
def server(model):
    origins = f"{ORIGIN},http://localhost:3000"
    with http_coordinator(model, "--api-key", KEY, "--cors-origins", origins) as coord:
        yield {"http": coord.http, "model": model.name}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["http"], api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _stream(tok: Tokenizer, ids: list[int], step: int = 1) -> str:
    stream = tok.detokenizer()
    out = [stream.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return "".join(out) + stream.finish()


@pytest.mark.parametrize(
    "text", [" Paris.", "  two spaces", "😀 then text", " 😀", "é means ü", "a b 中文 ", " "]
)
def test_streamed_detokenization_equals_decode(model, text):
    tok = Tokenizer(model)
    ids = tok.encode(text)
    assert tok.text(ids) == text  # the byte-level vocabulary spells anything
    for step in (1, 2, 3):  # one token per commit, or several (a WeDLM step)
        assert _stream(tok, ids, step) == text


def test_streamed_answers_equal_whole_answers(server, client):
    """Completions and chat, streamed and not, give the same text; at least one of these
    answers starts with a space (the character the stream used to drop)."""
    answers = []
    for prompt in ("The capital of France is", "one, two,", "She sells", "def main():"):
        args = {"model": server["model"], "max_tokens": 8, "extra_body": {"mode": "ar"}}
        whole = client.completions.create(prompt=prompt, **args).choices[0].text
        chunks = client.completions.create(prompt=prompt, stream=True, **args)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(messages=messages, **args)
        chunks = client.chat.completions.create(messages=messages, stream=True, **args)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == chat.choices[0].message.content
        answers += [whole, chat.choices[0].message.content]
    assert any(a.startswith(" ") for a in answers), answers


def test_context_overflow_in_openai_words(server, client):
    messages = [{"role": "user", "content": "one, two, three"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server["model"], messages=messages, max_tokens=600)
    body = err.value.body
    assert body["code"] == CONTEXT_EXCEEDED and body["param"] == "max_tokens"
    assert body["message"].startswith("This model's maximum context length is 512 tokens. ")
    assert "However, you requested " in body["message"] and "600 in the completion" in body[
        "message"
    ]
    # a prompt refused from its length alone, before it is tokenized
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server["model"], prompt="x " * 60_000, max_tokens=4)
    body = err.value.body
    assert body["code"] == CONTEXT_EXCEEDED and body["param"] == "prompt"
    assert body["message"].startswith("This model's maximum context length is 512 tokens. ")
    # a prompt that leaves no room for one token
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server["model"], prompt=[5] * 512)
    assert err.value.body["code"] == CONTEXT_EXCEEDED
    assert "maximum context length is 512" in err.value.body["message"]


def test_litellm_maps_overflow_to_context_window_error(server):
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=f"openai/{server['model']}", api_base=server["http"], api_key=KEY,
            messages=[{"role": "user", "content": "hello"}], max_tokens=600, num_retries=0,
        )  # fmt: skip


def test_refusals_that_overflow_say_so():
    """The engine's own check and the workers' KV budget word it the same way."""
    engine = Refused(INVALID, "exceeds", Overflow(512, 520, None, 16))
    err = from_refusal(engine, "max_tokens", prompt_name="messages")
    assert (err.status, err.code, err.param) == (400, CONTEXT_EXCEEDED, "messages")
    assert err.message.startswith("This model's maximum context length is 512 tokens. However, "
                                  "your messages resulted in 520 tokens")  # fmt: skip
    kv = Refused(TOO_LARGE, "KV", Overflow(300, 100, 250, 16, kv=True))
    err = from_refusal(kv, "max_tokens", prompt_name="prompt")
    assert (err.code, err.param) == (CONTEXT_EXCEEDED, "max_tokens")
    assert "maximum context length is 300 tokens on this cluster now" in err.message
    assert "you requested 366 tokens (100 in the prompt, 250 in the completion, 16 " in err.message


def test_cors_preflight_only_for_allowed_origins(server):
    url = f"{server['http']}/chat/completions"
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    allowed = httpx.options(url, headers={"Origin": ORIGIN, **ask})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = httpx.options(url, headers={"Origin": "https://evil.example", **ask})
    assert "access-control-allow-origin" not in other.headers
    # simple requests get the header too, errors included (a browser can read them)
    models = httpx.get(f"{server['http']}/models", headers={"Origin": ORIGIN})
    assert models.status_code == 401 and models.headers["access-control-allow-origin"] == ORIGIN
    ok = httpx.get(f"{server['http']}/models",
                   headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN


def test_cors_origins_flag_and_config(tmp_path):
    from coordinator.service.serve_config import load_serve_config
    from coordinator.service.server_cli import apply_config, build_parser, serve_options

    path = tmp_path / "c.toml"
    path.write_text(f"model = 'm'\ncors_origins = ['{ORIGIN}']\n")
    assert load_serve_config(path)["cors_origins"] == [ORIGIN]
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(path)])
    apply_config(args, args.subparser)
    assert args.cors_origins == [ORIGIN]
    args = parser.parse_args(["serve", "--config", str(path), "--cors-origins", "a, b"])
    apply_config(args, args.subparser)
    assert args.cors_origins == ["a", "b"]
    local = parser.parse_args(["local", "--model", "m", "--cors-origins", ORIGIN])
    assert serve_options(local, model=tmp_path).cors_origins == (ORIGIN,)
    path.write_text("cors_origins = [3]\n")
    with pytest.raises(Exception, match="cors_origins must be a list of origins"):
        load_serve_config(path)
