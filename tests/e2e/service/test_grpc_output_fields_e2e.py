"""The gRPC API's logprobs and output_format (structured output) through the real client
(wedlm_client) against a real coordinator process: streamed and submitted jobs, every
decoding mode, and INVALID_ARGUMENT with the field named for bad values."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from common.generation_params import GenerationParams
from common.proto_gen import wedlm_pb2 as pb
from tests.support.checkpoints import TOOL_CHAT_TEMPLATE
from tests.support.cluster_harness import cluster_name, start_coordinator
from wedlm_client.client import ClusterError, WedlmClient
from wedlm_client.request_building import request_from_params

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "size", "count"],
    "additionalProperties": False,
}
AS_SCHEMA = pb.OutputFormat(json_schema=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def client(checkpoint_dir):
    model = checkpoint_dir(
        "wedlm_qwen2", seed=5, chat_template=TOOL_CHAT_TEMPLATE, max_position_embeddings=2048
    )
    proc, address = start_coordinator(model, cluster_name(), "--no-bonjour")
    try:
        proc.expect("serving")
        with WedlmClient(address, timeout=120) as c:
            yield c
    finally:
        proc.stop()


def _document(final: dict) -> dict:
    return json.loads(re.sub(r"<\|[a-z_]+\|>$", "", final["text"]))


@pytest.mark.parametrize("mode", ["ar", "wedlm", "speculative"])
def test_json_schema_output_streamed_and_submitted(client, mode):
    params = GenerationParams(mode=mode, max_tokens=120, temperature=0.0)
    final = client.generate(text="a box of apples", params=params, output_format=AS_SCHEMA)
    assert final["finish_reason"] == "stop" and final["mode"] == mode
    jsonschema.validate(_document(final), SCHEMA)
    job_id = client.submit(text="a box of apples", params=params, output_format=AS_SCHEMA)
    job = client.wait_job(job_id, timeout_s=100)
    assert job.state == "done" and job.result.text == final["text"]  # greedy: the same


def test_regex_and_json_object(client):
    params = GenerationParams(mode="ar", max_tokens=40)
    final = client.generate(
        text="x", params=params, output_format=pb.OutputFormat(regex="[a-c]{5}")
    )
    assert re.fullmatch(r"[a-c]{5}(<\|[a-z_]+\|>)?", final["text"])
    obj = client.generate(text="x", params=GenerationParams(mode="ar", max_tokens=200),
                          output_format=pb.OutputFormat(json_object=True))  # fmt: skip
    assert obj["text"].startswith("{")


def test_logprobs_streamed_and_in_the_result(client):
    params = GenerationParams(mode="ar", max_tokens=10, logprobs=3)
    chunks = []
    request = request_from_params(params, text="hello there")
    final = None
    for event in client.stub.Generate(request, timeout=120):
        if event.WhichOneof("event") == "tokens":
            chunks.append(event.tokens)
        else:
            final = event.final
    streamed = [e for chunk in chunks for e in chunk.logprobs]
    assert [e.id for e in streamed] == list(final.tokens) == [e.id for e in final.logprobs]
    for e in final.logprobs:
        assert e.logprob <= 0 and len(e.top) == 3
        assert e.top[0].logprob >= e.top[1].logprob >= e.top[2].logprob
        assert e.top[0].id == e.id  # greedy: the likeliest
    job = client.wait_job(client.submit(text="hello there", params=params), timeout_s=60)
    assert [e.id for e in job.result.logprobs] == list(job.result.tokens)
    plain = client.generate(text="hello there", params=GenerationParams(mode="ar", max_tokens=4))
    assert "logprobs" not in plain


@pytest.mark.parametrize(
    ("fmt", "params", "message"),
    [
        (pb.OutputFormat(json_schema="{not json"), {}, "output_format.json_schema is not JSON"),
        (pb.OutputFormat(json_schema="[1]"), {},
         "output_format.json_schema: the JSON schema must be an object"),
        (pb.OutputFormat(json_schema='{"type": "nonsense"}'), {}, "output_format.json_schema"),
        (pb.OutputFormat(regex=""), {}, "output_format.regex is empty"),
        (pb.OutputFormat(lark="start: ("), {}, "output_format.lark"),
        (None, {"logprobs": 21}, "logprobs must be between 0 and 20"),
    ],
)  # fmt: skip
def test_bad_fields_are_invalid_argument(client, fmt, params, message):
    request = request_from_params(GenerationParams(max_tokens=4), text="x", output_format=fmt)
    if "logprobs" in params:  # GenerationParams refuses it on the client: send it raw
        request.logprobs = params["logprobs"]
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    with pytest.raises(ClusterError) as refused:  # Submit answers the same
        client._call("Submit", request)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
