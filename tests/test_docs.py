"""The docs a newcomer reads: the README within 2,000 words, each page of docs/ within 3,000, no
table cell over 400 characters (a cell that long is a paragraph hiding in a table), and no file
named in the docs or the code that a user's clone lacks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_WORDS, PAGE_WORDS, CELL_CHARACTERS = 2_000, 3_000, 400
PAGES = sorted((REPO / "docs").glob("*.md"))
# A path into the repository's own folders, as docs and docstrings name files.
NAMED_PATH = re.compile(
    r"(?<![\w/.-])((?:pipeline|stage1_score|stage2_train|apps|docs|benchmarks|manifests|tests|"
    r"experiments|scripts|requirements|\.ci)/[\w.*-]+(?:/[\w.*-]+)*/?)"
)
OUTSIDE_THE_CLONE = ("STYLE.md", "DESIGN.md", "REVIEW.md", "../shared")


def words(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").split())


def longest_cell(path: Path) -> int:
    cells = [
        cell.strip()
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.lstrip().startswith("|")
        for cell in line.split("|")
    ]
    return max(map(len, cells), default=0)


def test_the_readme_is_read_in_minutes():
    assert words(REPO / "README.md") <= README_WORDS


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.name)
def test_each_page_guides_within_its_length(page):
    assert words(page) <= PAGE_WORDS
    assert longest_cell(page) <= CELL_CHARACTERS


def test_no_readme_table_cell_is_a_paragraph():
    assert longest_cell(REPO / "README.md") <= CELL_CHARACTERS


def _texts() -> list[Path]:
    folders = ("pipeline", "apps", "stage1_score", "stage2_train", "docs", "manifests", "scripts")
    found = [REPO / "README.md", REPO / "pyproject.toml", REPO / "Makefile"]
    for folder in folders:
        found += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".toml")]
    return sorted(found)


def named_paths(text: str) -> set[str]:
    """Repository paths a text names: a file with its extension, or a folder with its slash;
    not a glob pattern, not a rate (docs/s)."""
    found = {match.rstrip(".") for match in NAMED_PATH.findall(text)}
    return {
        name for name in found
        if "*" not in name and (name.endswith("/") or re.search(r"\.\w+$", name))
    }


def test_every_file_the_docs_and_code_name_is_in_the_clone():
    missing = []
    for path in _texts():
        text = path.read_text(encoding="utf-8")
        for name in OUTSIDE_THE_CLONE:
            if name in text:
                missing.append(f"{path.relative_to(REPO)} names {name}, which a clone lacks")
        for named in sorted(named_paths(text)):
            if not (REPO / named).exists() and not _is_made_at_run_time(named):
                missing.append(f"{path.relative_to(REPO)} names {named}")
    assert not missing, "\n".join(missing)


def _is_made_at_run_time(named: str) -> bool:
    """Paths that name what a run writes (a results folder of a date, a run's files)."""
    return named.startswith(("benchmarks/results/", "docs/results/")) and not (
        REPO / named.split("/")[0] / named.split("/")[1]
    ).exists()


def test_the_path_check_finds_a_missing_file():
    text = "see `docs/no-such-page.md` and stage1_score/run.py, or pipeline/*.py at 9 docs/s."
    assert named_paths(text) == {"docs/no-such-page.md", "stage1_score/run.py"}
    assert not (REPO / "docs/no-such-page.md").exists()
