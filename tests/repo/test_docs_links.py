"""The front door's links hold: every relative link in README.md, docs/*.md and
benchmarks/RESULTS.md names a file that exists, and every #anchor a heading (as GitHub
makes its id) or an explicit <a id=...> in the file it points to. README stays a front
door that leads to each document behind it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
DOCS = ("api.md", "architecture.md", "operations.md", "models.md")
# The "at most ~300 lines", with room for a few lines the lead places.
README_MAX_LINES = 320

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def documents() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks/RESULTS.md",
    ]


def prose_lines(text: str, keep_code_spans: bool = False) -> Iterator[str]:
    """The lines outside fenced code blocks, inline code spans removed unless kept."""
    fence = ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = ""
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        yield line if keep_code_spans else CODE_SPAN.sub("", line)


def github_slug(heading: str) -> str:
    """The id GitHub gives a heading: link text kept, markup and punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every id a link can name in this file; repeated headings get -1, -2 as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for line in prose_lines(text, keep_code_spans=True):
        found.update(a.lower() for a in EXPLICIT_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per link in `path` that does not resolve: file, line, target, why."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for number, line in enumerate(prose_lines(path.read_text(encoding="utf-8")), start=1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, https:, mailto: are not checked here
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)} line {number}: ({target})"
            if not dest.exists():
                problems.append(f"{where} no such file")
                continue
            if anchor and dest.suffix == ".md":
                ids = cache.setdefault(dest, anchors(dest))
                if anchor.lower() not in ids:
                    problems.append(f"{where} no heading or <a id> '{anchor}' in {dest.name}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = [p for doc in documents() for p in broken_links(doc)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_reports_a_missing_file_and_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Run A1 — `gpu`, 2026\n")
    page.write_text(
        "# Page\n\n[ok](other.md#run-a1--gpu-2026) [self](#page)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere)\n"
        "`[in code](missing-too.md)`\n```\n[fenced](missing-three.md)\n```\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "missing.md" in problems[0] and "no such file" in problems[0]
    assert "'nowhere'" in problems[1]


def test_readme_is_a_front_door_to_the_documents_behind_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = readme.count("\n") + 1
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"
    for name in DOCS:
        doc = ROOT / "docs" / name
        assert doc.exists(), f"docs/{name} is missing"
        assert f"(docs/{name}" in readme, f"README.md does not link docs/{name}"
        first = next(p for p in doc.read_text(encoding="utf-8").split("\n\n")[1:] if p.strip())
        assert not first.startswith(("#", "|", "-", "```")), (
            f"docs/{name} should open with a sentence saying what it is for, not {first[:40]!r}"
        )


def test_readme_keeps_the_commands_ci_and_the_e2e_tests_run():
    """`.ci/run` runs "exactly the README's test command", and
    tests/e2e/cluster/test_local_cluster_e2e.py types the README's main command: the README
    must still show both, verbatim."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8").splitlines()
    marker = next(i for i, line in enumerate(ci) if line.startswith("# README test command"))
    test_command = ci[marker + 1].strip()
    assert test_command.startswith("python3 -m venv .venv"), test_command
    assert f"\n{test_command}\n" in readme, (
        f".ci/run's test command is not in README.md: {test_command}"
    )
    main = "wedlm-coordinator local --model default --workers 2 --chat --prompt"
    assert main in readme, f"README.md lost its main command ({main} ...)"
