"""The checked-in gRPC stubs are exactly what proto/wedlm.proto generates."""

from __future__ import annotations

import subprocess
import sys


def test_stubs_are_fresh():
    out = subprocess.run(
        [sys.executable, "-m", "common.proto_gen.regenerate", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
