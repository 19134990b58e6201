"""Paper Figure 1: how much of each teacher's vocabulary the student shares, as a table and chart.

The overlap itself (exact token-string matches) is `pipeline.vocab_overlap`; this module runs it
for several teachers and writes JSON, CSV, Markdown and a bar chart. Every CSV row names the
fingerprints of the two tokenizers it was computed from.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from apps.analysis.configs import VocabularyOverlapConfig
from apps.analysis.markdown import markdown_page
from pipeline.config import to_dict
from pipeline.io import atomic_write_json, atomic_write_text, fingerprint
from pipeline.tokenizer import load_tokenizer
from pipeline.versions import software_versions
from pipeline.vocab_overlap import vocabulary_overlap

JSON_NAME = "vocab_overlap.json"
CSV_NAME = "vocab_overlap.csv"
MARKDOWN_NAME = "vocab_overlap.md"
PNG_NAME = "vocab_overlap.png"
CSV_COLUMNS = (
    "student",
    "teacher",
    "shared",
    "student_vocab",
    "teacher_vocab",
    "shared_over_teacher",
    "shared_over_student",
    "student_fingerprint",
    "teacher_fingerprint",
)


def run_vocabulary_overlap(config: VocabularyOverlapConfig) -> dict:
    """Compare the student with every teacher; write JSON, CSV, Markdown and PNG to `config.out`."""
    student = load_tokenizer(config.student_tokenizer)
    rows = []
    for spec in config.teacher_tokenizers:
        teacher = load_tokenizer(spec)
        rows.append(
            {
                "student": student.spec,
                "teacher": teacher.spec,
                **vocabulary_overlap(student, teacher).to_dict(),
                "student_fingerprint": student.fingerprint,
                "teacher_fingerprint": teacher.fingerprint,
            }
        )
    producer = {
        "analysis": "vocab_overlap",
        "config": {k: v for k, v in to_dict(config).items() if k != "out"},
        "tokenizers": {row["teacher"]: row["teacher_fingerprint"] for row in rows}
        | {student.spec: student.fingerprint},
        "software": software_versions(),
    }
    report = {**producer, "fingerprint": fingerprint(producer), "rows": rows}
    atomic_write_json(config.out / JSON_NAME, report)
    atomic_write_text(config.out / CSV_NAME, vocabulary_overlap_csv(rows))
    atomic_write_text(config.out / MARKDOWN_NAME, vocabulary_overlap_markdown(report))
    plot_vocabulary_overlap(report, config.out / PNG_NAME)
    return report


def vocabulary_overlap_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def vocabulary_overlap_markdown(report: dict) -> str:
    student = report["rows"][0]["student"]
    table = [
        "| teacher | teacher vocabulary | shared tokens | % of teacher vocabulary "
        f"| % of {student} vocabulary |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        table.append(
            f"| {row['teacher']} | {row['teacher_vocab']:,} | {row['shared']:,} "
            f"| {100 * row['shared_over_teacher']:.2f}% | {100 * row['shared_over_student']:.2f}% |"
        )
    return markdown_page(
        f"Vocabulary overlap with the student {student}",
        None,
        table,
        f"{student} has {report['rows'][0]['student_vocab']:,} tokens. A token is shared when the "
        "same token string is in both vocabularies (added tokens included).",
        report["fingerprint"],
        f"{JSON_NAME} for the tokenizers' fingerprints",
    )


def plot_vocabulary_overlap(report: dict, dest: Path) -> None:
    import numpy as np

    from apps.analysis.plotting import new_figure, save_png

    rows = report["rows"]
    student = rows[0]["student"]
    x = np.arange(len(rows))
    width = 0.38
    fig, (ax,) = new_figure(width_per_panel=max(5.0, 1.3 * len(rows) + 2))
    for offset, key, label in (
        (-width / 2, "shared_over_teacher", "% of the teacher's vocabulary"),
        (width / 2, "shared_over_student", f"% of {student}'s vocabulary"),
    ):
        values = [100 * row[key] for row in rows]
        bars = ax.bar(x + offset, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}%" for v in values], fontsize=7, padding=2)
    ax.set_xticks(x, [row["teacher"] for row in rows])
    ax.set_xlabel("teacher tokenizer")
    ax.set_ylabel("shared token strings (%)")
    ax.set_ylim(0, 112)
    ax.set_title(f"Vocabulary shared with the student ({student})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    save_png(fig, dest, f"vocagno vocab_overlap {report['fingerprint']}")
