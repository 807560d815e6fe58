"""The coordinator's TOML config and the wire request → parameters translation."""

from __future__ import annotations

import re

import pytest

from common.errors import InvalidRequest, WedlmError
from common.generation_params import GenerationParams
from common.proto_gen import wedlm_pb2 as pb
from coordinator.service.request_parsing import params_from_request
from coordinator.service.serve_config import load_serve_config
from wedlm_client.request_building import request_from_params


def test_example_config_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".config" / "wedlm-cluster").mkdir(parents=True)
    (tmp_path / ".config" / "wedlm-cluster" / "secret").write_text("s3cret\n")
    cfg = load_serve_config("deploy/cluster.example.toml")
    assert cfg["cluster"] == "studio" and cfg["expect"] == 3 and cfg["secret"] == "s3cret"
    assert cfg["workers"][0] == "mac-studio.local:50061"
    assert cfg["keep_finished"] == 10000
    assert cfg["http_port"] == 8000 and cfg["default_max_tokens"] == 2048


def test_api_key_file(tmp_path):
    (tmp_path / "key").write_text("k3y\n")
    path = tmp_path / "c.toml"
    path.write_text(f"api_key_file = '{tmp_path / 'key'}'\nhttp_port = 0")
    assert load_serve_config(path) == {"api_key": "k3y", "http_port": 0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model = 3", "model (model folder, 'default' or a Hugging Face hub id) must be a str"),
        ("colour = 'red'", "unknown setting 'colour'"),
        ("expect = -1", "expect must be 0 or more"),
        ("layers = '2-3'", "must start at 0"),
        ("wait_for_workers = 0", "wait_for_workers must be positive"),
        ("keep_finished = -1", "keep_finished must be positive"),
        ("workers = ['nohost']", "HOST:PORT"),
        ("bonjour = 'yes'", "bonjour (find workers over Bonjour) must be a bool"),
        ("secret_file = '/nonexistent/secret'", "cannot read secret_file"),
        ("[coordinator\nmodel = 'x'", "not valid TOML"),
        ("http_port = 70000", "http_port must be in [0, 65535]"),
        ("http_port = '8000'", "http_port (port of the OpenAI-compatible HTTP API) must be an int"),
        ("api_key_file = '/nonexistent/key'", "cannot read api_key_file"),
        ("default_max_tokens = 0", "default_max_tokens must be positive"),
        ("max_request_bytes = 100", "max_request_bytes must be at least 4096"),
    ],
)
def test_bad_configs(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(WedlmError, match=re.escape(message)):
        load_serve_config(path)


def test_missing_config():
    with pytest.raises(WedlmError, match="not found"):
        load_serve_config("/nonexistent/cluster.toml")


def test_request_round_trip():
    for params in (
        GenerationParams(),
        GenerationParams(mode="ar", temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=9),
        GenerationParams(threshold=None, window=6, penalty=0.1, stop_ids=(2,), stop_strings=("x",)),
    ):
        req = request_from_params(params, text="hi")
        back = params_from_request(req)
        assert back == params


def test_request_defaults_and_errors():
    assert params_from_request(pb.GenerateRequest(text="x")) == GenerationParams()
    with pytest.raises(InvalidRequest, match="window"):
        params_from_request(pb.GenerateRequest(text="x", window=0))
    with pytest.raises(InvalidRequest, match="exclusive"):
        params_from_request(pb.GenerateRequest(text="x", threshold=0.5, one_by_one=True))


def test_a_setting_has_the_same_bounds_as_flag_and_as_key(tmp_path):
    """Flags and TOML keys are made from one field each (serve_settings.py): a value the
    flag takes, the key takes; one it refuses, the key refuses."""
    from coordinator.service.server_cli import build_parser

    parser = build_parser()
    path = tmp_path / "c.toml"
    path.write_text("metrics_port = 0\nkv_group_size = 32\n")
    args = parser.parse_args(["serve", "--model", "m", "--metrics-port", "0"])
    assert args.metrics_port == 0 == load_serve_config(path)["metrics_port"]
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--kv-bits", "3"])
    path.write_text("kv_bits = 3\n")
    with pytest.raises(WedlmError, match=re.escape("kv_bits must be 4 or 8, got 3")):
        load_serve_config(path)
