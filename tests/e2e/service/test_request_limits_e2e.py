"""No request can take the coordinator's memory: bodies and gRPC messages over the request
limit are refused at the door (413 / RESOURCE_EXHAUSTED) without being read, prompts that
cannot fit the context are refused without being tokenized whole, and neither slows the
requests around them. One real coordinator on 127.0.0.1 (a tiny model with a 16k context,
so that the default limit is 1.5 MiB), its memory read with psutil."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import httpx
import openai
import psutil
import pytest

from common.generation_params import GenerationParams
from common.proto_gen import wedlm_pb2 as pb
from common.tokenizer import Tokenizer
from coordinator.service.request_limits import BYTES_PER_TOKEN, ROOM_BYTES
from tests.support.cluster_harness import cluster_name, start_coordinator
from wedlm_client.client import ClusterError, WedlmClient
from wedlm_client.request_building import request_from_params

CONTEXT = 16384
LIMIT = CONTEXT * BYTES_PER_TOKEN + ROOM_BYTES  # the default for this context
MB = 1 << 20
CHUNK = b"x" * MB
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    model = checkpoint_dir("qwen3", seed=36, max_position_embeddings=CONTEXT)
    coord, address = start_coordinator(model, cluster_name(), "--no-bonjour", "--http-port", "0")
    try:
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        coord.expect("serving")
        srv = {"address": address, "http": http, "model": model.name, "proc": coord,
               "tokenizer": Tokenizer(model), "pid": coord.popen.pid}  # fmt: skip
        for _ in range(3):  # first-use allocations (template, tokenizer) before any RSS is read
            small(srv)
        yield srv
    finally:
        coord.stop()


def rss(server) -> int:
    return psutil.Process(server["pid"]).memory_info().rss


def small(server) -> float:
    """Seconds for a short chat completion (checked to succeed)."""
    start = time.perf_counter()
    body = {"model": server["model"], "messages": HELLO, "max_tokens": 2}
    answer = httpx.post(f"{server['http']}/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - start


@contextmanager
def refused_quickly(server, seconds: float = 2.5) -> Iterator[None]:
    """The block answers within `seconds`; the coordinator's RSS grows by less than 100 MB
    meanwhile and comes back to within 10% of what it was. The block includes the client
    building and sending its tens of MB (refusals take 0.06-0.18 s on an idle 2-core
    machine, 92 s before the limits): the bound leaves room for a loaded CI runner, it is
    not the refusal's cost."""
    before = rss(server)
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    after = rss(server)
    assert elapsed < seconds, f"refused after {elapsed:.2f} s"
    assert after - before < 100 * MB and after < before * 1.1, (before, after)


def body_of(megabytes: int) -> Iterator[bytes]:
    """A chat request of about `megabytes` MB, made of one reused chunk."""
    yield b'{"model": "m", "messages": [{"role": "user", "content": "'
    for _ in range(megabytes):
        yield CHUNK
    yield b'"}]}'


def post_large(server, declared: bool, megabytes: int = 200) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if declared:  # httpx then sends the generator as a plain body of that length
        headers["content-length"] = str(sum(len(p) for p in body_of(megabytes)))
    url = f"{server['http']}/chat/completions"
    return httpx.post(url, content=body_of(megabytes), headers=headers, timeout=30)


def test_limits_are_reported(server):
    assert f"request limits: {LIMIT:,} bytes" in "".join(server["proc"].log)
    card = httpx.get(f"{server['http']}/models").json()["data"][0]
    assert card["max_model_len"] == CONTEXT
    status = subprocess.run(
        [sys.executable, "-m", "wedlm_client.cli", "status", "--cluster", server["address"]],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert f"requests up to {LIMIT:,} bytes" in status
    assert f"prompts up to {CONTEXT:,} tokens" in status


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_large_http_body_refused_at_the_door(server, declared):
    with refused_quickly(server):
        answer = post_large(server, declared)
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert f"over this server's limit of {LIMIT:,} bytes" in error["message"]
    if declared:
        assert re.search(r"the request body is 209,7\d\d,\d{3} bytes", error["message"])


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["http"], api_key="none", max_retries=0, timeout=30)


def test_openai_client_sees_413(server):
    with openai_client(server) as client, pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": "x" * LIMIT}]
        )
    assert err.value.status_code == 413 and f"{LIMIT:,} bytes" in err.value.body["message"]


def generate_bytes(client: WedlmClient, **prompt) -> Callable[[], list]:
    """The client's Generate with its request serialized beforehand, so that a clock around
    the call times the server's answer rather than the client's encoding of 20 MB."""
    payload = request_from_params(GenerationParams(), **prompt).SerializeToString()
    call = client.channel.unary_stream(
        "/wedlm.v1.Coordinator/Generate", request_serializer=None,
        response_deserializer=pb.GenerateEvent.FromString,
    )  # fmt: skip
    return lambda: list(call(payload, timeout=30))


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_large_grpc_message_refused(server, kind):
    """50 MB of text; 20 MB of token ids (4M ids of 5 bytes each)."""
    prompt = {"text": "x" * (50 * MB)} if kind == "text" else {"ids": [2**30] * (4 * MB)}
    with WedlmClient(server["address"], timeout=30) as client:
        with pytest.raises(ClusterError) as err:  # as users call it
            client.generate(**prompt)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"vs. {LIMIT})" in str(err.value)  # grpc's "larger than max (SIZE vs. LIMIT)"
        generate = generate_bytes(client, **prompt)
        with refused_quickly(server), pytest.raises(grpc.RpcError) as err:
            generate()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_token_ids_past_the_context(server):
    ids = [5] * (CONTEXT + 1)
    with WedlmClient(server["address"], timeout=30) as client, pytest.raises(ClusterError) as err:
        client.generate(ids=ids)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "16,385 token ids, more than this model's context of 16,384 tokens" in str(err.value)
    body = {"model": server["model"], "prompt": ids, "max_tokens": 1}
    answer = httpx.post(f"{server['http']}/completions", json=body, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt" and "16,385 token ids" in error["message"]


def three_contexts(tokenizer: Tokenizer) -> str:
    """A text of about three contexts of tokens."""
    sentence = "The quick brown fox jumps over the lazy dog, one two three four five. "
    per = len(tokenizer.encode(sentence * 10)) / 10
    text = sentence * int(3 * CONTEXT / per)
    assert len(text) < tokenizer.longest_token_chars * CONTEXT  # not refused by length
    return text


def test_prompt_of_three_contexts_refused_before_tokenized_whole(server):
    text = three_contexts(server["tokenizer"])
    first_part = re.compile(r"\(([\d,]+) in its first ([\d,]+) of ([\d,]+) characters\)")
    client = openai_client(server)
    with client, refused_quickly(server), pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": text}]
        )
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    message = err.value.body["message"]
    assert f"more than {CONTEXT:,} tokens, this model's context" in message
    counted, read, total = (int(g.replace(",", "")) for g in first_part.search(message).groups())
    assert counted > CONTEXT and read < total / 2  # stopped early: the rest never tokenized
    client = WedlmClient(server["address"], timeout=30)
    with client, refused_quickly(server), pytest.raises(ClusterError) as err:
        client.generate(text=text)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert first_part.search(str(err.value))


def test_prompt_longer_than_any_context_refused_by_its_length(server):
    longest = server["tokenizer"].longest_token_chars
    text = "y" * (CONTEXT * longest + 1)
    body = {"model": server["model"], "prompt": text, "max_tokens": 1}
    with refused_quickly(server):
        answer = httpx.post(f"{server['http']}/completions", json=body, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, "
        f"the prompt is {len(text):,} characters, more than this model's context of "
        f"{CONTEXT:,} tokens can hold ({CONTEXT * longest:,} characters at {longest} per "
        "token at most). Please reduce the length of the prompt."
    )


def test_many_messages_just_under_the_limit(server):
    """40,000 chat messages in 1.4 MB: parsed on a worker thread (half a second of it), then
    refused by the rendered prompt's length, before it is tokenized."""
    many = {"model": server["model"], "messages": [{"role": "user", "content": "hi"}] * 40_000}
    body = json.dumps(many).encode()
    assert len(body) < LIMIT
    before = rss(server)
    answer = httpx.post(f"{server['http']}/chat/completions", content=body, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "However, the prompt is 1,200,022 characters, more than" in error["message"]
    assert rss(server) - before < 100 * MB  # the parsed messages' peak, not kept alive
    small(server)


def test_small_requests_keep_their_pace_meanwhile(server):
    """While large bodies and messages are refused, short requests answer about as fast as
    alone (reading or parsing 200 MB would hold them for seconds)."""
    alone = statistics.median(small(server) for _ in range(7))
    before = rss(server)
    stop = threading.Event()
    refused: list[int] = []

    def flood() -> None:  # light on this process's GIL: the bytes are made once
        with WedlmClient(server["address"], timeout=30) as client:
            generate = generate_bytes(client, text="x" * (50 * MB))
            while not stop.is_set():
                for declared in (True, False):
                    refused.append(post_large(server, declared).status_code)
                with pytest.raises(grpc.RpcError):
                    generate()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        meanwhile = statistics.median(small(server) for _ in range(7))
    finally:
        stop.set()
        thread.join(60)
    assert refused and set(refused) == {413}, refused
    assert meanwhile < 2 * alone + 0.1, (alone, meanwhile)  # slack for a busy CI machine
    assert rss(server) < before * 1.1
