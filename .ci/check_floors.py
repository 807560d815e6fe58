"""After a lowest-direct install: is every direct dependency of the project (and of the
extras named) installed at exactly its declared lower bound? A bound that the resolver
could not reach (another dependency needs more) is not what the tests ran, so it fails
here until it is raised to what they do run.

    python .ci/check_floors.py server test-tools
"""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PROJECT = "wedlm-cluster"


def direct_requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    optional = project["project"]["optional-dependencies"]
    found, todo, seen = [], [None, *extras], set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        specs = project["project"]["dependencies"] if extra is None else optional[extra]
        for req in map(Requirement, specs):
            if req.marker is not None and not req.marker.evaluate({"extra": extra or ""}):
                continue
            if canonicalize_name(req.name) == PROJECT:
                todo.extend(req.extras)
            else:
                found.append(req)
    return found


def floor(req: Requirement) -> Version | None:
    bounds = [Version(c.version) for c in req.specifier if c.operator in (">=", "==")]
    return max(bounds) if bounds else None


def main(extras: list[str]) -> int:
    wrong = []
    reqs = direct_requirements(extras)
    for req in reqs:
        low = floor(req)
        try:
            installed = Version(version(req.name))
        except PackageNotFoundError:
            wrong.append(f"{req.name}: not installed")
            continue
        if low is not None and Version(installed.public) != low:
            wrong.append(f"{req.name}: declared >= {low}, installed {installed}")
    for line in wrong:
        print(f"lower bound not what was tested: {line}", file=sys.stderr)
    if not wrong:
        print(f"{len(reqs)} direct dependencies installed at their declared lower bounds")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
