"""A Hugging Face hub cache made by a test, laid out as huggingface_hub writes one
(HF_HUB_CACHE/models--org--name: content-addressed blobs, a snapshot of links to them,
refs/main), so that a hub id resolves with HF_HUB_OFFLINE=1 and no network."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_to_hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """Put the files of folder `model` into the hub cache at `root` as `repo_id`'s main
    revision; returns `root` (what HF_HUB_CACHE names)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(model.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return root
