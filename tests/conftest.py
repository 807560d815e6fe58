"""Shared fixtures: tiny random checkpoints made by the tests, and engines over them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
# What starts real coordinator/worker processes, a pip install or a browser lives here:
# marked `e2e` by its folder, so `pytest -m "not e2e"` is the quick loop.
E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """make(family, seed=0, **overrides) -> a cached tiny checkpoint folder."""
    from tests.support.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    made: dict[tuple, Path] = {}

    def make(family: str, seed: int = 0, **overrides) -> Path:
        key = (family, seed, tuple(sorted(overrides.items())))
        if key not in made:
            name = f"{family}-{seed}-{len(made)}"
            made[key] = make_checkpoint(root / name, family, seed=seed, **overrides)
        return made[key]

    return make


def shared_model(name: str) -> Path:
    path = SHARED_MODELS / name
    if not (path / "config.json").exists():
        pytest.skip(f"{path} is absent (the shared models folder ships beside the repo)")
    return path
