"""docs/paper-results.md: the paper's Tables 1 and 2 as copied add up (each AVG is its row's mean
within the paper's rounding), every paper manifest has its row, and the lm-eval tasks the page
names are lm-eval's."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "paper-results.md"
BENCHMARKS = 9  # GSM8K .. SAT, then AVG, AVG† (without the starred), AVG‡ (without SAT)
STARRED = (5, 7, 8)  # TAB, MMLU-STEM, SAT
ROUNDING = 0.05 + 1e-9  # the paper prints one decimal


def _table(heading: str) -> list[list[str]]:
    """The body rows of the first table after `heading`, as cells."""
    lines = PAGE.read_text(encoding="utf-8").split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i, line in enumerate(lines[start:], start) if not line.startswith("|"))
    return [
        [cell.strip() for cell in line.strip("|").split("|")] for line in lines[start + 2 : end]
    ]


TABLE1, TABLE2 = _table("## Table 1"), _table("## Table 2")


@pytest.mark.parametrize("row", TABLE1 + TABLE2, ids=lambda row: " ".join(row[:2]))
def test_each_average_is_its_rows_mean(row):
    scores = [None if cell == "-" else float(cell) for cell in row[3:]]
    benchmarks, (avg, unstarred, without_sat) = scores[:BENCHMARKS], scores[BENCHMARKS:]
    kept = [s for i, s in enumerate(benchmarks) if i not in STARRED]
    assert unstarred == pytest.approx(sum(kept) / len(kept), abs=ROUNDING)
    if avg is not None:  # the Rho-1 row reports only the unstarred columns
        assert avg == pytest.approx(sum(benchmarks) / BENCHMARKS, abs=ROUNDING)
        assert without_sat == pytest.approx(sum(benchmarks[:-1]) / (BENCHMARKS - 1), abs=ROUNDING)


def test_the_abstracts_gains_are_the_best_rows_averages():
    """46% over TinyLlama-CPT and 33% over ULD (abstract), from the Qwen2.5-Math-Inst rows."""
    avg = {(row[0], row[1]): float(row[-3]) for row in TABLE1 if row[-3] != "-"}
    ours = avg["S + Qwen2.5-Math-Inst", "Ours"]
    assert round(ours / avg["TinyLlama-CPT", "-"] - 1, 2) == 0.46
    assert round(ours / avg["S + Qwen2.5-Math-Inst", "ULD"] - 1, 2) == 0.33


def test_every_paper_manifest_has_its_row_and_every_row_its_manifest():
    named = [re.findall(r"`([\w.-]+\.toml)`", row[2]) for row in TABLE1 + TABLE2]
    names = [name for names in named for name in names]
    paper = REPO / "manifests" / "paper"
    on_disk = {p.name for p in paper.glob("table[12]-*.toml")}
    assert sorted(names) == sorted(on_disk)  # each once
    assert len(TABLE1) == 17 and len(TABLE2) == 9  # the paper's rows


def test_the_lm_eval_tasks_named_are_lm_evals():
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        pytest.skip("lm-eval is not installed (pip install -e '.[eval]')")
    text = PAGE.read_text(encoding="utf-8").split("## The closest lm-evaluation-harness", 1)[1]
    named = set(re.findall(r"`([a-z0-9_]+)`", text)) - {"exact_match", "acc", "strict"}
    command = re.search(r"--tasks (\S+)", text)[1].split(",")
    assert set(command) <= named and len(named) >= 7
    known = set()
    tasks = Path(spec.submodule_search_locations[0]) / "tasks"
    for path in tasks.rglob("*.yaml"):  # task, group and tag names, and a group's members
        found = re.finditer(r"^(?:task|group|tag): *([\w-]+)|^  - ([\w-]+)$", path.read_text(
            encoding="utf-8", errors="replace"), re.M)  # fmt: skip
        known |= {m[1] or m[2] for m in found}
    assert named <= known, sorted(named - known)
