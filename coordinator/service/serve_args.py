"""ServeOptions from the parsed flags that `serve` and `local` share (server_cli.py,
local_cluster.py both use it; it imports neither). Each setting's flag has its field's name
(its `dest`), so the options are read field by field: nothing here names a setting but the
few whose value is resolved (the model folders, the state folder)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.engine.limits import Limits
from coordinator.engine.limits import knobs as limit_knobs
from coordinator.knobs import knobs
from coordinator.service.serve_settings import ServeSettings

if TYPE_CHECKING:
    from coordinator.service.serve_options import ServeOptions


def state_dir(flag: Path | None) -> Path | None:
    if flag is not None:
        return None if str(flag) == "none" else flag
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "wedlm-cluster"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "wedlm-cluster"


def serve_options(args: argparse.Namespace, **fixed) -> ServeOptions:
    """ServeOptions from the settings' flags (`local` has no serve-only ones: their defaults),
    with `fixed` ones in place of the flags'."""
    from coordinator.engine.local_engine import resolve_model
    from coordinator.service.serve_options import ServeOptions

    serve = getattr(args, "command", "serve") == "serve"
    values = {
        f.name: getattr(args, f.name) for f, k in knobs(ServeSettings) if serve or not k.serve_only
    }
    values["state_dir"] = state_dir(args.state_dir)
    values["limits"] = Limits(**{f.name: getattr(args, f.name) for f, _ in limit_knobs()})
    values.update(fixed)
    for name in ("model", "draft_model"):  # a folder, 'default' or a hub id: its folder
        if isinstance(values[name], str) and values[name]:
            values[name] = resolve_model(values[name])
    return ServeOptions(**values)
