"""Local work needs no gRPC: `wedlm generate --model` runs with grpc made unimportable (as
with a grpcio older than the generated stubs accept, which they refuse at import), and the
client package, the coordinator's CLI and the engine load neither grpc nor the stubs until
they talk to a cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NoGrpc(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("grpc", "grpc_health", "grpc_reflection") or (
                name == "common.proto_gen.wedlm_pb2_grpc"
            ):
                raise ImportError(f"{name} is blocked: local work must not need it")
            return None

    sys.meta_path.insert(0, NoGrpc())
    import wedlm_client, coordinator  # noqa: E401
    from coordinator.service.server_cli import build_parser
    from wedlm_client.cli import main

    build_parser().parse_args(["serve", "--model", sys.argv[1]])
    code = main(["generate", "--model", sys.argv[1], "--prompt", "hello", "--max-tokens", "4",
                 "--json"])
    loaded = [m for m in ("grpc", "common.proto_gen.wedlm_pb2_grpc") if m in sys.modules]
    print(json.dumps({"code": code, "loaded": loaded}))
    """
)


def test_local_generation_imports_no_grpc(checkpoint_dir):
    model = str(checkpoint_dir("wedlm_qwen3", seed=11))
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    generated, report = json.loads(lines[-2]), json.loads(lines[-1])
    assert report == {"code": 0, "loaded": []}
    assert len(generated["tokens"]) == 4 or generated["finish_reason"] == "stop"
