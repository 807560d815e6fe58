"""Each serve setting is declared once (a ServeSettings field): the server's ServeOptions is
those fields, and serve_options fills every one of them from its flag, with no hand copy."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from common.errors import WedlmError
from common.kv_format import KVFormat
from coordinator.knobs import knobs
from coordinator.service.serve_options import ServeOptions
from coordinator.service.serve_settings import ServeSettings
from coordinator.service.server_cli import build_parser, serve_options

# a value other than the default for each setting, on its own flag
FLAGS = {
    "host": ("--host", "0.0.0.0", "0.0.0.0"),
    "port": ("--port", "7000", 7000),
    "cluster": ("--cluster", "lab", "lab"),
    "secret": ("--secret", "s3", "s3"),
    "workers": ("--worker", "h:1", ["h:1"]),
    "expect": ("--expect", "3", 3),
    "max_running": ("--max-running", "5", 5),
    "micro_batches": ("--micro-batches", "2", 2),
    "tp": ("--tp", "2", 2),
    "metrics_port": ("--metrics-port", "0", 0),
    "http_port": ("--http-port", "8080", 8080),
    "api_key": ("--api-key", "k", "k"),
    "served_model_name": ("--served-model-name", "m", "m"),
    "cors_origins": ("--cors-origins", "https://a,https://b", ("https://a", "https://b")),
    "kv_group_size": ("--kv-group-size", "32", 32),
    "prefix_cache_tokens": ("--prefix-cache-tokens", "100", 100),
    "default_max_tokens": ("--default-max-tokens", "9", 9),
    "max_request_bytes": ("--max-request-bytes", "2000000", 2000000),
    "kv_reserve_tokens": ("--kv-reserve-tokens", "10", 10),
    "keep_finished": ("--keep-finished", "7", 7),
    "wait_timeout": ("--wait-for-workers", "2.5", 2.5),
    "warm_up": ("--warm-up", "off", "off"),
    "state_dir": ("--state-dir", "/tmp/jobs", Path("/tmp/jobs")),
}
SWITCHES = {"bonjour": "--no-bonjour", "local_layers": "--no-local-layers"}


def test_serve_options_are_the_settings_fields():
    """No setting is declared a second time: ServeOptions has each ServeSettings field
    under its one name, and its own fields are only what code sets or derives."""
    setting_names = [f.name for f, _ in knobs(ServeSettings)]
    option_names = [f.name for f in fields(ServeOptions)]
    assert option_names[: len(setting_names)] == setting_names
    extra = set(option_names) - set(setting_names)
    assert extra == {"limits", "recovery_timeout_s", "cost_cache", "kv", "tls"}


def test_every_flag_reaches_its_option(tmp_path):
    argv = ["serve", "--model", str(tmp_path), "--kv-bits", "8", "--prefill-hold", "0"]
    for flag, text, _ in FLAGS.values():
        argv += [flag, text]
    argv += SWITCHES.values()
    opts = serve_options(build_parser().parse_args(argv))
    assert opts.model == tmp_path
    for name, (_, _, value) in FLAGS.items():
        assert getattr(opts, name) == value, name
    for name in SWITCHES:
        assert getattr(opts, name) is False, name
    assert opts.kv == KVFormat(8, 32) and opts.limits.prefill_hold == 0
    tested = {*FLAGS, *SWITCHES, "model", "kv_bits"}
    untested = {"layers", "prefix_cache", "draft_model", "tls_cert", "tls_key", "tls_ca"}
    assert tested | untested == {f.name for f, _ in knobs(ServeSettings)}


def test_local_takes_the_serve_only_settings_defaults(tmp_path):
    """`local --workers 3` counts workers to start: it is not serve's --worker list."""
    args = build_parser().parse_args(["local", "--model", str(tmp_path), "--workers", "3"])
    opts = serve_options(args, model=tmp_path, expect=3)
    assert opts.workers == [] and opts.expect == 3 and opts.bonjour is True


def test_a_bad_kv_setting_is_refused_in_one_line(tmp_path):
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--kv-bits", "4"])
    args.kv_group_size = 48  # what a TOML file could hold past the flag's choices
    with pytest.raises(WedlmError, match=r"kv group size must be one of .*, got 48"):
        serve_options(args)


def test_the_secret_and_the_api_key_default_to_their_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("WEDLM_SECRET", "from-env")
    monkeypatch.setenv("WEDLM_API_KEY", "")  # set but empty: no key
    opts = serve_options(build_parser().parse_args(["serve", "--model", str(tmp_path)]))
    assert opts.secret == "from-env" and opts.api_key is None
    argv = ["serve", "--model", str(tmp_path), "--secret", "flag", "--api-key", "k"]
    opts = serve_options(build_parser().parse_args(argv))
    assert opts.secret == "flag" and opts.api_key == "k"  # the flag wins
