"""The documentation holds together: the README is a short guide, every path and link it and
docs/*.md give resolves, and every report the README cites is in docs/results.md with the rest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# a backticked path starting with one of these names a file or folder of the repository
CHECKED_ROOTS = ("reports/", "docs/", "configs/", "artifacts/", "scripts/", "data/")
# a placeholder or a glob, not a path: `reports/<name>.json`, `configs/accelerate/*.yaml`, ...
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.")
README_MAX_LINES = 260


def prose(text: str) -> str:
    """The page without its fenced code blocks (commands and their outputs, not references)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def links(text: str) -> list[str]:
    """The targets of the page's ``[text](target)`` links, outside code."""
    text = re.sub(r"`[^`]*`", "", prose(text).replace("](", "\0"))  # inline code is not a link
    return re.findall(r"\0([^)\s]+)\)", text)


def backticked_paths(text: str) -> list[str]:
    """Paths under the repository's checked folders that the page writes in backticks; a command
    (`scripts/cpu_results.sh engine-bench`) is checked by its first word."""
    found = []
    for span in re.findall(r"`([^`]+)`", prose(text)):
        words = span.split()
        if not words or not words[0].startswith(CHECKED_ROOTS):
            continue
        path = words[0].rstrip(".,;:")
        if not PLACEHOLDER.search(path):
            found.append(path)
    return found


def broken_references(page: Path, root: Path) -> list[str]:
    """Every link (relative to the page's folder) and backticked path (relative to ``root``) of
    ``page`` that names nothing on disk."""
    text = page.read_text()
    broken = []
    for target in links(text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = target.split("#", 1)[0]
        if PLACEHOLDER.search(path):
            continue
        if not (page.parent / path).exists():
            broken.append(f"link {target}")
    for path in backticked_paths(text):
        if not (root / path).exists():
            broken.append(f"path `{path}`")
    return broken


def test_the_pages_are_there():
    names = {page.name for page in PAGES}
    assert {"README.md", "design.md", "evaluator.md", "exactness.md", "formats.md",
            "results.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_and_backticked_path_resolves(page):
    broken = broken_references(page, REPO)
    assert not broken, f"{page.relative_to(REPO)} names what does not exist: {broken}"


def test_a_broken_link_or_path_is_caught(tmp_path):
    """The check itself: a page naming a missing file fails, by link and by backticked path."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "here.json").write_text("{}")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[fine](../reports/here.json#top) [gone](../reports/gone.json) [web](https://x.org/a)\n"
        "[anchor](#section) `reports/here.json` `reports/missing.json`, `reports/<name>.json`\n"
        "`scripts/absent.sh stage` `configs/*/x.yaml` `runs/anything`\n"
        "```bash\nls reports/in_a_command.json [x](nowhere.md)\n```\n")
    assert broken_references(page, tmp_path) == [
        "link ../reports/gone.json", "path `reports/missing.json`", "path `scripts/absent.sh`"]


def test_the_readme_is_a_short_guide():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): measured results and "
        f"how they were taken belong in docs/results.md")


def test_every_report_the_readme_cites_is_in_the_results_page():
    readme = (REPO / "README.md").read_text()
    results = (REPO / "docs" / "results.md").read_text()
    cited = set(re.findall(r"reports/[\w.\-]+\.json", readme))
    missing = sorted(report for report in cited if report not in results)
    assert not missing, f"README.md cites reports docs/results.md does not: {missing}"
