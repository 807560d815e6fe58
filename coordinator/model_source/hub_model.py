"""A model named by its Hugging Face hub id (`org/name`): downloaded once into the hub's
own cache by huggingface_hub (only the files serving needs, mlx-lm's selection), or found
there offline (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import re
from pathlib import Path

from common.errors import CheckpointError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def looks_like_repo_id(name: str) -> bool:
    return bool(REPO_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def download_model(repo_id: str) -> Path:
    """The local snapshot folder of `repo_id`, downloading what is missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except GatedRepoError:
        raise CheckpointError(
            f"{repo_id} is gated on the Hugging Face hub: accept its terms and log in "
            "(hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo_id} is neither a folder here nor a model on the Hugging Face hub"
        ) from None
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{repo_id} is not a folder here and not in the Hugging Face cache, and the hub "
            "cannot be reached (offline: HF_HUB_OFFLINE is set, or no network)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"downloading {repo_id} from the Hugging Face hub: {e}") from None
