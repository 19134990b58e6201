"""`vocagno align`: output shape and values, and clear one-line errors; `vocagno overlap`, folded
into `vocagno analyze overlap` (tests/test_analysis.py), refused in one line naming it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import zstandard

from apps.cli import main
from pipeline.tokenizer import load_tokenizer
from tests.test_alignment import reference_align

TEXTS = ["Probability, Uncertainty", "Tom has 3 apples 🍎 and eats 1.\nHow many are left?"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def expected_record(text: str, student: str, teacher: str) -> dict:
    """The record `vocagno align` must print, its map from the per-token reference (Algorithm 1
    spelled out), not from the code under test."""
    s, t = load_tokenizer(student).encode(text), load_tokenizer(teacher).encode(text)
    map_start, map_end = reference_align(s.start, s.end, t.start, t.end)
    return {
        "student": {"ids": s.ids.tolist(), "start": s.start.tolist(), "end": s.end.tolist()},
        "teacher": {"ids": t.ids.tolist(), "start": t.start.tolist(), "end": t.end.tolist()},
        "map_start": map_start.tolist(),
        "map_end": map_end.tolist(),
    }


def test_align_text_prints_one_json_object_with_the_alignment(capsys):
    code, out, err = run_cli(
        capsys, "align", "--student-tokenizer", "tinyllama", "--teacher-tokenizer", "qwen2.5",
        "--text", TEXTS[0],
    )  # fmt: skip
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert list(record) == ["student", "teacher", "map_start", "map_end"]
    assert list(record["student"]) == list(record["teacher"]) == ["ids", "start", "end"]
    # TinyLlama frames with BOS (unmapped); Figure 2's 7 tokens follow, onto Qwen2.5's 4.
    assert record["student"]["ids"][0] == 1
    assert record["map_start"] == [-1, 0, 0, 0, 1, 2, 2, 3]
    assert record["map_end"] == [-1, 0, 0, 0, 1, 2, 3, 3]
    assert record == expected_record(TEXTS[0], "tinyllama", "qwen2.5")


def test_align_text_that_has_no_utf8_spelling_is_one_line(capsys):
    # Undecodable command-line bytes reach Python as lone surrogates.
    code, out, err = run_cli(
        capsys, "align", "--student-tokenizer", "tinyllama", "--teacher-tokenizer", "qwen2.5",
        "--text", "a\udcffb",
    )  # fmt: skip
    assert code == 2 and out == ""
    assert err.startswith("vocagno align: error: --text holds a lone surrogate U+DCFF")
    assert err.count("\n") == 1


def test_align_no_bos_and_eos_change_the_framing(capsys):
    code, out, _ = run_cli(
        capsys, "align", "--student-tokenizer", "mistral", "--teacher-tokenizer", "deepseek",
        "--text", TEXTS[0], "--no-bos", "--eos",
    )  # fmt: skip
    record = json.loads(out)
    assert code == 0
    assert len(record["student"]["ids"]) == 8 + 1  # Figure 2's 8 Mistral tokens, then EOS
    assert record["student"]["ids"][-1] == load_tokenizer("mistral").eos_id
    assert record["teacher"]["ids"][-1] == load_tokenizer("deepseek").eos_id
    assert record["map_start"][-1] == record["map_end"][-1] == -1
    assert record["student"]["start"][-1] == record["student"]["end"][-1] == len(TEXTS[0])


def test_align_streams_a_jsonl_zst_input_in_order(capsys, tmp_path):
    path = tmp_path / "docs.jsonl.zst"
    rows = [{"id": i, "body": text} for i, text in enumerate(TEXTS * 40)]  # more than one batch
    lines = "".join(json.dumps(row) + "\n" for row in rows).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    code, out, err = run_cli(
        capsys, "align", "--student-tokenizer", "smollm2", "--teacher-tokenizer", "mistral",
        "--input", str(path), "--text-column", "body",
    )  # fmt: skip
    assert code == 0 and err == ""
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == len(rows)
    expected = [expected_record(text, "smollm2", "mistral") for text in TEXTS]
    assert all(record == expected[i % 2] for i, record in enumerate(records))


def test_align_human_prints_a_table(capsys):
    code, out, _ = run_cli(
        capsys, "align", "--student-tokenizer", "tinyllama", "--teacher-tokenizer", "qwen2.5",
        "--text", TEXTS[0], "--human",
    )  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("# document 1 (--text): 8 student tokens (tinyllama)")
    assert "1 unmapped" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 8
    assert rows[0][:5] == ["0", "<s>", '""', "0-0", "-"]
    assert rows[6] == ["6", "certain", '"certain"', "15-22", "2..3", '"', 'Unc"', '"ertainty"']


def test_overlap_is_refused_in_one_line_naming_analyze_overlap(capsys):
    code, out, err = run_cli(
        capsys, "overlap", "--student-tokenizer", "tinyllama", "--teacher-tokenizer", "qwen2.5"
    )
    assert code == 2 and out == ""
    assert err.startswith("vocagno overlap: error: replaced by vocagno analyze overlap ")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "content, extra, message",
    [
        (None, [], "does not exist"),
        ('{"text": "fine"}\n{"body": "no text"}\n', [], "record 1: no field 'text' (fields: 'body')"),
        ('{"text": "fine"}\n{"text": "fine"}\n', ["--text-column", "doc"], "(fields: 'text')"),
        ('{"text": "fine"}\n{"text": "cut\n', [], "record 1: not valid JSON"),
    ],
)
def test_align_bad_input_is_one_line_on_stderr(capsys, tmp_path, content, extra, message):
    path = tmp_path / "docs.jsonl"
    if content is not None:
        path.write_text(content)
    code, _, err = run_cli(
        capsys, "align", "--student-tokenizer", "tinyllama", "--teacher-tokenizer", "qwen2.5",
        "--input", str(path), *extra,
    )  # fmt: skip
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("vocagno align: error: ") and str(path) in err and message in err


def test_align_skip_reports_bad_records_and_aligns_the_rest(capsys, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one"}\nnot json\n{"text": "three"}\n')
    code, out, err = run_cli(
        capsys, "align", "--student-tokenizer", "qwen2.5", "--teacher-tokenizer", "deepseek",
        "--input", str(path), "--on-bad-record", "skip",
    )  # fmt: skip
    assert code == 0 and len(out.splitlines()) == 2
    assert err.startswith("vocagno align: skipped docs.jsonl record 1: not valid JSON")


def test_console_script_exits_non_zero_with_one_line_for_a_bad_tokenizer():
    result = subprocess.run(
        [sys.executable, "-m", "apps.cli", "align", "--student-tokenizer", "tinyllama",
         "--teacher-tokenizer", "/no/such/tokenizer.json", "--text", "hello"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "vocagno align: error: tokenizer file /no/such/tokenizer.json does not exist"
    ]
