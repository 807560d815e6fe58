"""The checked-in gRPC stubs are exactly what proto/wedlm.proto generates, and the
declared lower bounds of grpcio and protobuf are runtimes those stubs accept."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
STUBS = ROOT / "common" / "proto_gen"


def test_stubs_are_fresh():
    out = subprocess.run(
        [sys.executable, "-m", "common.proto_gen.regenerate", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def declared_floors() -> dict[str, Version]:
    """Each dependency's `>=` bound, from the base install and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs.extend(extra)
    floors = {}
    for spec in specs:
        req = Requirement(spec)
        for clause in req.specifier:
            if clause.operator == ">=":
                floors[req.name] = Version(clause.version)
    return floors


def test_lower_bounds_match_the_stubs():
    grpc_gen = re.search(
        r"GRPC_GENERATED_VERSION = '([^']+)'", (STUBS / "wedlm_pb2_grpc.py").read_text()
    )
    proto_gen = re.search(r"Protobuf Python Version: (\S+)", (STUBS / "wedlm_pb2.py").read_text())
    assert grpc_gen and proto_gen
    floors = declared_floors()
    # the stubs refuse an older runtime at import (grpc's own services need grpcio >= them)
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert floors[name] >= Version(grpc_gen.group(1)), name
    assert floors["protobuf"] >= Version(proto_gen.group(1))
