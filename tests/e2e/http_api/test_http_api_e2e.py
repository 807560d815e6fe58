"""The OpenAI-compatible HTTP API, driven by the official `openai` package against a real
cluster: a coordinator holding layers 0-1 and a worker process holding 2-3, on 127.0.0.1.
Also the API key on gRPC, and gRPC reflection read by grpcio's reflection client."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from common.generation_params import GenerationParams
from common.tokenizer import Tokenizer
from coordinator.engine.local_engine import open_local_engine
from tests.support.cluster_harness import (
    cluster_name,
    start_coordinator,
    start_worker,
    worker_kv_sequences,
)
from wedlm_client.client import ClusterError, WedlmClient

KEY = "test-api-key"
QUESTION = [{"role": "user", "content": "what is a cluster of machines for"}]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("wedlm_qwen2", seed=43, num_hidden_layers=4)


@pytest.fixture(scope="module")
def cluster(model):
    name = cluster_name()
    procs = []
    try:
        worker, worker_address = start_worker(model, name, "--layers", "2-3", "--no-bonjour")
        procs.append(worker)
        coord, address = start_coordinator(
            model, name, "--no-bonjour", "--worker", worker_address, "--expect", "1",
            "--layers", "0-1", "--http-port", "0", "--api-key", KEY,
            "--max-running", "2", "--max-queued", "2",
        )  # fmt: skip
        procs.append(coord)
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        coord.expect("serving")
        yield {"address": address, "http": http, "worker": worker_address, "model": model.name}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster["http"], api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def chat(client, cluster, **kw):
    args = {"model": cluster["model"], "messages": QUESTION, "max_tokens": 12,
            "extra_body": {"mode": "ar"}}  # fmt: skip
    args.update(kw)
    return client.chat.completions.create(**args)


def streamed(client, cluster, **kw):
    chunks = list(chat(client, cluster, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_health_and_api_key(cluster, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [cluster["model"]]
    assert client.models.retrieve(cluster["model"]).id == cluster["model"]
    other = openai.OpenAI(base_url=cluster["http"], api_key="wrong-key", max_retries=0)
    with other, pytest.raises(openai.AuthenticationError) as err:
        chat(other, cluster)
    assert err.value.status_code == 401 and "Incorrect API key" in err.value.body["message"]
    body = {"model": cluster["model"], "messages": QUESTION}
    missing = httpx.post(f"{cluster['http']}/chat/completions", json=body)
    assert missing.status_code == 401 and "Missing API key" in missing.json()["error"]["message"]
    root = cluster["http"].removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200
    ready = httpx.get(f"{root}/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_greedy_chat_equals_wedlm_generate(cluster, client):
    for mode, extra in (("ar", {}), ("wedlm", {"window": 8, "threshold": 1.5})):
        cli = subprocess.run(
            [sys.executable, "-m", "wedlm_client.cli", "generate", "--cluster",
             cluster["address"], "--api-key", KEY, "--chat", "--prompt", QUESTION[0]["content"],
             "--mode", mode, "--max-tokens", "12", "--json",
             *[a for k, v in extra.items() for a in (f"--{k}", str(v))]],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        expected = json.loads(cli.stdout)
        answer = chat(client, cluster, extra_body={"mode": mode, **extra})
        assert answer.choices[0].message.content == expected["text"]
        assert answer.choices[0].message.role == "assistant"
        assert answer.usage.completion_tokens == len(expected["tokens"])
        assert answer.usage.prompt_tokens == expected["prompt_tokens"]
        assert answer.choices[0].finish_reason == expected["finish_reason"]
        assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    short = chat(client, cluster, max_tokens=None, max_completion_tokens=3)
    assert short.usage.completion_tokens <= 3


def test_streaming_with_usage_matches_the_whole_answer(cluster, client):
    whole = chat(client, cluster, max_tokens=16)
    text, chunks = streamed(client, cluster, max_tokens=16, stream_options={"include_usage": True})
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    # WeDLM commits several tokens in one step: they arrive as one event
    wedlm = {"mode": "wedlm", "window": 8, "threshold": 50.0}
    text, chunks = streamed(client, cluster, max_tokens=16, extra_body=wedlm)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) < 16 and text


def test_stop_strings_end_the_answer_before_them(cluster, client):
    full = chat(client, cluster, max_tokens=24).choices[0].message.content
    assert len(full) > 8, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    for stops in (stop, [stop, "never appears"]):
        answer = chat(client, cluster, max_tokens=24, stop=stops)
        assert answer.choices[0].message.content == expected
        assert answer.choices[0].finish_reason == "stop"
        text, _ = streamed(client, cluster, max_tokens=24, stop=stops)
        assert text == expected


def test_seed_reproduces_sampling(cluster, client):
    def sample(seed):
        return chat(client, cluster, max_tokens=16, temperature=1.0, seed=seed).choices[0]

    first = sample(7).message.content
    assert sample(7).message.content == first
    assert any(sample(s).message.content != first for s in (1, 2, 3))


def test_completions_take_text_or_token_ids(cluster, client, model):
    prompt = "a cluster of machines"
    answer = client.completions.create(
        model=cluster["model"], prompt=prompt, max_tokens=10, extra_body={"mode": "ar"}
    )
    assert answer.object == "text_completion" and answer.choices[0].text
    with WedlmClient(cluster["address"], api_key=KEY) as grpc_client:
        ids = Tokenizer(model).encode(prompt)
        expected = grpc_client.generate(ids=ids, params=GenerationParams(mode="ar", max_tokens=10))
    by_ids = client.completions.create(
        model=cluster["model"], prompt=ids, max_tokens=10, extra_body={"mode": "ar"}
    )
    assert by_ids.choices[0].text == answer.choices[0].text == expected["text"]
    assert by_ids.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(
        model=cluster["model"], prompt=prompt, max_tokens=10, stream=True,
        extra_body={"mode": "ar"},
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]


BAD_FIELDS = [
    ({"n": 17}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"seed": "seven"}, "seed"),
    ({"extra_body": {"window": 999}}, "window"),
    ({"extra_body": {"mode": "beam"}}, "mode"),
    ({"extra_body": {"mode": "diffusion"}}, "mode"),  # a mode this (WeDLM) model lacks
    ({"extra_body": {"sampler": "fast"}}, "sampler"),
    ({"extra_body": {"penalty": -1}}, "penalty"),
    ({"extra_body": {"threshold": 0.5, "one_by_one": True}}, "one_by_one"),
    ({"extra_body": {"stop_token_ids": [-3]}}, "stop_token_ids"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS, ids=[p for _, p in BAD_FIELDS])
def test_invalid_fields_are_400_naming_the_field(cluster, client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, cluster, **fields)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in err.value.body["message"]


def test_unknown_model_and_malformed_bodies(cluster, client):
    with pytest.raises(openai.NotFoundError) as err:
        chat(client, cluster, model="no-such-model")
    assert err.value.body["code"] == "model_not_found"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{cluster['http']}/chat/completions"
    for body in (b"{not json", b"[]", json.dumps({"messages": QUESTION}).encode()):
        reply = httpx.post(url, content=body, headers=headers)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"]
    missing = httpx.post(url, json={"messages": QUESTION}, headers=headers).json()["error"]
    assert missing["param"] == "model" and "required" in missing["message"]
    assert httpx.get(f"{cluster['http']}/nowhere", headers=headers).status_code == 404


def test_disconnect_frees_kv_and_overload_is_429(cluster, client, model):
    identity = open_local_engine(model).engine.config.identity
    body = {"model": cluster["model"], "messages": QUESTION, "max_tokens": 400,
            "stream": True, "mode": "ar"}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{cluster['http']}/chat/completions"
    with httpx.Client(timeout=60) as raw:
        streams = []
        for _ in range(4):  # 2 running + 2 queued: the limits of this coordinator
            cm = raw.stream("POST", url, json=body, headers=headers)
            reply = cm.__enter__()
            assert reply.status_code == 200
            streams.append((cm, reply))
        lines = (line for line in streams[0][1].iter_lines() if line.startswith("data:"))
        next(lines), next(lines)  # the role chunk, then tokens: the first request is decoding
        assert worker_kv_sequences(cluster["worker"], identity) >= 1
        start = time.monotonic()
        with pytest.raises(openai.RateLimitError) as err:
            chat(client, cluster)
        assert time.monotonic() - start < 5
        assert err.value.status_code == 429 and "overloaded" in err.value.body["message"]
        for cm, _ in streams:  # every client goes away mid-answer
            cm.__exit__(None, None, None)
    deadline = time.monotonic() + 10
    with WedlmClient(cluster["address"], api_key=KEY) as grpc_client:
        while time.monotonic() < deadline:
            status = grpc_client.cluster_status()
            # the worker keeps only the rows the prefix cache holds (cancelled requests
            # leave theirs to it)
            kv = worker_kv_sequences(cluster["worker"], identity) - status.prefix_cache.entries
            if status.running == status.queued == kv == 0:
                break
            time.sleep(0.2)
    assert (status.running, status.queued, kv) == (0, 0, 0)
    metrics = httpx.get(f"{cluster['http'].removesuffix('/v1')}/metrics").text
    assert 'wedlm:http_requests_total{method="POST",route="/v1/chat/completions",status="429"}' in (
        metrics
    )


def test_grpc_needs_the_api_key(cluster):
    with WedlmClient(cluster["address"], api_key="") as anonymous:
        with pytest.raises(ClusterError) as err:
            anonymous.model_info()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with WedlmClient(cluster["address"], api_key="wrong") as wrong:
        with pytest.raises(ClusterError) as err:
            wrong.cluster_status()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with WedlmClient(cluster["address"], api_key=KEY) as good:
        assert good.model_info().num_layers == 4


def test_reflection_lists_and_calls_the_service(cluster):
    """What grpcurl does: list services and methods, then call one, with no .proto."""
    with grpc.insecure_channel(cluster["address"]) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = database.get_services()
        assert "wedlm.v1.Coordinator" in services and "grpc.health.v1.Health" in services
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName("wedlm.v1.Coordinator")
        methods = {m.name for m in service.methods}
        assert {"Generate", "Submit", "WaitJob", "ClusterStatus", "ModelInfo"} <= methods
        method = service.methods_by_name["ModelInfo"]
        request_class = GetMessageClass(method.input_type)
        reply_class = GetMessageClass(method.output_type)
        call = channel.unary_unary(
            "/wedlm.v1.Coordinator/ModelInfo",
            request_serializer=request_class.SerializeToString,
            response_deserializer=reply_class.FromString,
        )
        reply = call(request_class(), metadata=(("authorization", f"Bearer {KEY}"),), timeout=10)
        assert reply.num_layers == 4 and reply.model_name == cluster["model"]


def test_not_ready_is_503(model):
    """A coordinator still waiting for the layers it cannot hold answers 503, HTTP and
    health alike."""
    coord, _ = start_coordinator(
        model, cluster_name(), "--no-bonjour", "--no-local-layers", "--http-port", "0"
    )
    try:
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        waiting = openai.OpenAI(base_url=http, api_key="none", max_retries=0)
        with waiting, pytest.raises(openai.InternalServerError) as err:
            waiting.chat.completions.create(model=model.name, messages=QUESTION)
        assert err.value.status_code == 503 and "not ready" in err.value.body["message"]
        assert httpx.get(f"{http.removesuffix('/v1')}/health/ready").status_code == 503
    finally:
        coord.stop()
