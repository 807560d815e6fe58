"""The decoding modes are declared once (common/modes.py): the validation, the HTTP schemas
and the client's CLI take their words from it, and a Mode member reads, compares, hashes
and serializes as its word, so a member and a string are interchangeable everywhere."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from common.errors import InvalidRequest
from common.generation_params import MODES, GenerationParams
from common.modes import CAUSAL_MODES, DIFFUSION_MODES, Mode
from common.proto_gen import wedlm_pb2 as pb
from coordinator.http_api.schemas import CompletionRequest
from wedlm_client.request_building import request_from_params


def test_the_words_and_their_order_are_the_published_ones() -> None:
    assert MODES == ("auto", "wedlm", "ar", "speculative", "diffusion")
    assert all(type(m) is str for m in MODES + CAUSAL_MODES + DIFFUSION_MODES)
    assert CAUSAL_MODES == ("auto", "wedlm", "ar", "speculative")
    assert DIFFUSION_MODES == ("auto", "diffusion")


def test_a_member_is_its_word() -> None:
    assert GenerationParams(mode=Mode.AR) == GenerationParams(mode="ar")
    assert repr(GenerationParams(mode=Mode.AR)) == repr(GenerationParams(mode="ar"))
    assert {Mode.SPECULATIVE: 3}["speculative"] == 3
    assert json.dumps({"mode": Mode.WEDLM}) == '{"mode": "wedlm"}'
    assert pb.GenerateRequest(mode=Mode.DIFFUSION).SerializeToString() == (
        pb.GenerateRequest(mode="diffusion").SerializeToString()
    )
    with pytest.raises(
        InvalidRequest,
        match=r"^draft 'mask' applies to mode speculative only "
        r"\(mode is 'ar'\)$",
    ):
        GenerationParams(mode=Mode.AR, draft="mask")


def test_every_front_door_takes_the_same_words() -> None:
    with pytest.raises(
        InvalidRequest, match=r"^mode must be one of auto, wedlm, ar, speculative, diffusion, "
    ):
        GenerationParams(mode="fast")
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "mode": "fast"})
    assert "Input should be 'auto', 'wedlm', 'ar', 'speculative' or 'diffusion'" in str(err.value)
    for mode in Mode:
        assert (
            CompletionRequest.model_validate(
                {"model": "m", "prompt": "hi", "mode": mode.value}
            ).mode
            == mode
        )
        assert request_from_params(GenerationParams(mode=mode), text="hi").mode == mode.value
