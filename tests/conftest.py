"""Shared fixtures: tiny random checkpoints made by the tests, and engines over them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"

# End-to-end files (real coordinator and worker processes, or a pip install): marked `e2e`,
# so `pytest -m "not e2e"` is the quick loop. Files named *_e2e.py, and these:
E2E_FILES = {"test_diffusion_cluster.py", "test_client_package.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        if name.endswith("_e2e.py") or name in E2E_FILES:
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
