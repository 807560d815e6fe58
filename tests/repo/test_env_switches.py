"""Every WEDLM_* environment variable is declared in common/env_switches.py, in its
documented lists, and read there alone: no other product module names one in its code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common import env_switches, fused_projections
from common.env_switches import GROUP_BOUND_S, TEST_SWITCHES, USER_VARIABLES
from common.errors import WedlmError
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
PRODUCT = ("common", "coordinator", "shard_worker", "wedlm_client")
NAMED = re.compile(r"\bWEDLM_[A-Z_]*[A-Z]\b")
QUOTED = re.compile(r"[\"']WEDLM_[A-Z_]+[\"']")  # a name as code uses it, not in a sentence


def _sources() -> list[Path]:
    return [p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if "proto_gen" not in p.parts]


def test_every_variable_is_in_the_lists_and_read_only_there():
    declared = {v.name for v in (*USER_VARIABLES, *TEST_SWITCHES)}
    assert len(declared) == len(USER_VARIABLES) + len(TEST_SWITCHES)
    mentioned, quoted = set(), []
    for path in _sources():
        text = path.read_text()
        mentioned |= set(NAMED.findall(text))
        if path != Path(env_switches.__file__) and QUOTED.search(text):
            quoted.append(str(path.relative_to(ROOT)))
    assert mentioned == declared, mentioned ^ declared  # none outside the lists, none unused
    assert not quoted  # read through its EnvVar, not by its name


def test_a_switch_is_read_at_each_call(monkeypatch):
    """An A/B run flips a switch inside one process (fused projections here)."""
    monkeypatch.setenv("WEDLM_FUSED_PROJECTIONS", "0")
    assert not fused_projections.enabled()
    monkeypatch.delenv("WEDLM_FUSED_PROJECTIONS")
    assert fused_projections.enabled()  # its default: on


def test_a_bad_number_says_which_variable(monkeypatch):
    assert GROUP_BOUND_S.number() == 20.0
    monkeypatch.setenv("WEDLM_GROUP_BOUND_S", "soon")
    with pytest.raises(WedlmError, match=r"^WEDLM_GROUP_BOUND_S must be a number \(.*'soon'$"):
        GROUP_BOUND_S.number()
