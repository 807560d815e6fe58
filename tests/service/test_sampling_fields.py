"""The per-request fields of issue 33 (logprobs, grammar, penalties, logit_bias): validated
by GenerationParams, and kept by the job store (a restarted coordinator resumes them)."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequest
from common.generation_params import GenerationParams
from coordinator.service.job_store import decode_request, encode_request


def test_fields_survive_the_job_store():
    params = GenerationParams(logprobs=3, grammar='start: "x"', presence_penalty=0.5,
                              frequency_penalty=-1.0, repetition_penalty=1.2,
                              logit_bias=((5, 1.0), (7, -100.0)))  # fmt: skip
    prompt, back, _ = decode_request(encode_request([1, 2], params, None))
    assert back == params and prompt == [1, 2]


@pytest.mark.parametrize(
    "fields",
    [
        {"logprobs": 21},
        {"logprobs": -1},
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((1, 100.5),)},
        {"logit_bias": ((-1, 1.0),)},
    ],
)
def test_out_of_range_fields_are_refused(fields):
    name = next(iter(fields))
    with pytest.raises(InvalidRequest, match=name):
        GenerationParams(**fields)


def test_penalties_make_a_request_sequential():
    assert GenerationParams(presence_penalty=0.1).penalized
    assert GenerationParams(repetition_penalty=1.1).penalized
    assert not GenerationParams(logit_bias=((1, 5.0),)).penalized
