"""Regenerate the Python stubs from proto/wedlm.proto:

    python -m common.proto_gen.regenerate          # write them
    python -m common.proto_gen.regenerate --check  # exit 1 if the checked-in ones are stale
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE.parents[1] / "proto"
FILES = ("wedlm_pb2.py", "wedlm_pb2.pyi", "wedlm_pb2_grpc.py")


def generate(out: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO_DIR / "wedlm.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    grpc_file = out / "wedlm_pb2_grpc.py"
    text = grpc_file.read_text().replace(
        "import wedlm_pb2 as wedlm__pb2", "from . import wedlm_pb2 as wedlm__pb2"
    )
    grpc_file.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if not args.check:
        generate(HERE)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [f for f in FILES if (Path(tmp) / f).read_text() != (HERE / f).read_text()]
    if stale:
        print(f"stale stubs: {', '.join(stale)}; run python -m common.proto_gen.regenerate")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
