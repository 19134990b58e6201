"""`vocagno analyze`: the paper's Figures 1, 3/6 and training curves, on the shipped assets.

The chunk and overlap findings are asserted on the real tokenizers and real documents: they are
what the figures exist to show, so a change that breaks them must fail here.
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from apps.analysis.chunk_overlap import measure_chunk_overlap, run_chunk_overlap
from apps.analysis.configs import ChunkOverlapConfig, TrainingCurvesConfig
from apps.analysis.training_curves import FIELDS, plot_training_curves, read_metrics
from apps.cli import main
from pipeline.alignment import (
    chunk_alignment_overlap,
    chunk_starts,
    equal_chunk_alignment,
    span_overlap,
)
from pipeline.corpus import Corpus
from pipeline.errors import VocagnoError
from pipeline.io import read_bytes
from pipeline.shipped import shipped_corpus, shipped_tokenizer_file
from pipeline.tokenizer import load_tokenizer, shipped_tokenizers

TRAIN_CORPUS = shipped_corpus("train")
CHUNKS = [1, 2, 4, 8, 16, 32, 64]


def assert_png(path: Path, description_has: str) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width > 200 and image.height > 200
        assert description_has in image.info["Description"]
        image.verify()


# --- overlap (Figure 1) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def overlap_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("overlap")
    teachers = ["tinyllama", "mistral", "qwen2.5", "deepseek", "smollm2"]
    argv = ["analyze", "overlap", "--student-tokenizer", "tinyllama", "--teacher-tokenizers"]
    assert main([*argv, *teachers, "--out", str(out)]) == 0
    return out


def test_overlap_reproduces_the_papers_figure_1(overlap_out):
    rows = {
        row["teacher"]: row
        for row in json.loads((overlap_out / "vocab_overlap.json").read_text())["rows"]
    }
    assert list(rows) == ["tinyllama", "mistral", "qwen2.5", "deepseek", "smollm2"]
    # A teacher with the student's own tokenizer shares all of it.
    assert (
        rows["tinyllama"]["shared_over_teacher"] == rows["tinyllama"]["shared_over_student"] == 1.0
    )
    assert round(100 * rows["qwen2.5"]["shared_over_teacher"], 2) == 6.32  # the paper's number
    assert rows["mistral"]["shared_over_teacher"] > 0.7  # both SentencePiece, 32k vocabularies
    assert min(rows, key=lambda t: rows[t]["shared_over_teacher"]) == "qwen2.5"
    for row in rows.values():
        assert row["shared"] / row["teacher_vocab"] == row["shared_over_teacher"]
        assert row["shared"] / row["student_vocab"] == row["shared_over_student"]


def token_strings(name: str) -> set[str]:
    """A shipped tokenizer's token strings as its tokenizer.json stores them: the model's
    vocabulary and the added tokens (the definition the paper's Figure 1 counts)."""
    data = json.loads(read_bytes(shipped_tokenizer_file(shipped_tokenizers()[name]["file"])))
    assert isinstance(data["model"]["vocab"], dict)  # BPE: token string -> id
    return set(data["model"]["vocab"]) | {token["content"] for token in data["added_tokens"]}


def test_overlap_files_agree(overlap_out):
    report = json.loads((overlap_out / "vocab_overlap.json").read_text())
    with open(overlap_out / "vocab_overlap.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["teacher"] for r in table] == [r["teacher"] for r in report["rows"]]
    markdown = (overlap_out / "vocab_overlap.md").read_text()
    student = token_strings("tinyllama")
    for from_csv, from_json in zip(table, report["rows"], strict=True):
        teacher = token_strings(from_json["teacher"])
        shared = len(student & teacher)
        assert from_json["shared"] == int(from_csv["shared"]) == shared
        assert from_json["teacher_vocab"] == int(from_csv["teacher_vocab"]) == len(teacher)
        assert from_json["student_vocab"] == int(from_csv["student_vocab"]) == len(student)
        assert float(from_csv["shared_over_teacher"]) == from_json["shared_over_teacher"]
        assert from_csv["teacher_fingerprint"] == load_tokenizer(from_json["teacher"]).fingerprint
        row = f"| {from_json['teacher']} | {len(teacher):,} | {shared:,} "
        assert f"{row}| {100 * shared / len(teacher):.2f}% |" in markdown
    assert_png(overlap_out / "vocab_overlap.png", report["fingerprint"])


@pytest.mark.parametrize(
    ("teachers", "message"),
    [
        (["qwen2.5", "qwen2.5"], "teacher tokenizers must not repeat"),
        (["no-such-tokenizer"], "no tokenizer at 'no-such-tokenizer'"),
    ],
)
def test_overlap_command_rejects_bad_teachers(tmp_path, capsys, teachers, message):
    argv = ["analyze", "overlap", "--student-tokenizer", "tinyllama", "--teacher-tokenizers"]
    assert main([*argv, *teachers, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


# --- chunks (Figures 3 and 6) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def chunk_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("chunks")
    config = ChunkOverlapConfig(
        student_tokenizer="tinyllama",
        teacher_tokenizer="qwen2.5",
        input=str(TRAIN_CORPUS),
        num_docs=40,
        chunks=CHUNKS,
        out=out,
    )
    return run_chunk_overlap(config), out


def test_token_level_alignment_covers_every_student_character(chunk_report):
    token = chunk_report[0]["token_level"]
    assert token["ios"] == 1.0
    assert token["unscored"] == 0
    # Every student token with text is scored; the BOS and EOS that stage 2 adds have none.
    assert token["scored"] == chunk_report[0]["student_tokens"] - 2 * chunk_report[0]["documents"]


@pytest.mark.parametrize("num_chunks", [8, 64])
def test_analysis_scores_the_chunks_the_trainer_trains_with(num_chunks):
    """`analyze chunks` pairs exactly the chunks that --guidance chunk trains with: the student
    tokenized as stage 2 does (BOS, EOS), the teacher as stage 1 caches it, both cut as
    equal_chunk_alignment cuts them."""
    text = next(iter(Corpus(str(TRAIN_CORPUS)))).text
    student, teacher = load_tokenizer("tinyllama"), load_tokenizer("qwen2.5")
    s_enc, t_enc = student.encode(text, add_eos=True), teacher.encode(text)
    assert s_enc.ids[0] == student.bos_id and s_enc.ids[-1] == student.eos_id
    map_start, map_end = equal_chunk_alignment(len(s_enc), len(t_enc), num_chunks)
    first = np.flatnonzero(chunk_starts(np.array([len(s_enc)]), num_chunks))
    last = np.append(first[1:], len(s_enc)) - 1
    expected_iou, _ = span_overlap(
        s_enc.start[first],
        s_enc.end[last],
        t_enc.start[map_start[first]],
        t_enc.end[map_end[first]],
    )
    iou, _ = chunk_alignment_overlap(s_enc.start, s_enc.end, t_enc.start, t_enc.end, num_chunks)
    np.testing.assert_allclose(iou, expected_iou)
    measured = measure_chunk_overlap(student, teacher, [text], [num_chunks])
    assert measured.by_chunks[num_chunks].iou == pytest.approx(expected_iou.sum())


def test_chunk_iou_falls_as_chunks_get_finer(chunk_report):
    report, _ = chunk_report
    assert report["documents"] == 40
    assert [row["num_chunks"] for row in report["chunks"]] == CHUNKS
    iou = [row["iou"] for row in report["chunks"]]
    ios = [row["ios"] for row in report["chunks"]]
    assert iou[0] == ios[0] == 1.0  # one chunk is the whole text on both sides
    assert all(a > b for a, b in itertools.pairwise(iou)), iou
    assert all(a > b for a, b in itertools.pairwise(ios)), ios
    # The paper's point: fine chunks overlap far worse than token-level alignment does.
    assert iou[-1] < report["token_level"]["iou"] < 1.0


def test_chunk_report_files(chunk_report):
    report, out = chunk_report
    saved = json.loads((out / "chunk_overlap.json").read_text())
    assert saved == report
    assert saved["config"]["num_docs"] == 40 and saved["student_tokenizer"]["spec"] == "tinyllama"
    assert saved["teacher_tokenizer"]["fingerprint"] == load_tokenizer("qwen2.5").fingerprint
    markdown = (out / "chunk_overlap.md").read_text()
    assert "| 64 equal chunks |" in markdown and report["fingerprint"] in markdown
    assert_png(out / "chunk_overlap.png", report["fingerprint"])


def test_identical_tokenizers_align_perfectly_at_every_granularity():
    texts = [doc.text for doc in itertools.islice(Corpus(str(TRAIN_CORPUS)), 10)]
    mistral = load_tokenizer("mistral")
    for text in texts:
        enc = mistral.encode(text, add_eos=True)
        for n in CHUNKS:
            iou, ios = chunk_alignment_overlap(enc.start, enc.end, enc.start, enc.end, n)
            assert (iou == 1.0).all() and (ios == 1.0).all()
    overlap = measure_chunk_overlap(mistral, mistral, texts, CHUNKS).to_json()
    assert overlap["token_level"]["iou"] == overlap["token_level"]["ios"] == 1.0
    # As trained, the student side carries the EOS that stage 2 appends and the cached teacher
    # side does not: one token more shifts the equal cuts a little even for one tokenizer.
    pairs = [(mistral.encode(text, add_eos=True), mistral.encode(text)) for text in texts]
    expected = [pooled_chunk_iou(pairs, n) for n in CHUNKS]
    assert expected[0] == 1.0 and expected[1] < 1.0  # one chunk is the whole text; two are not
    np.testing.assert_allclose([row["iou"] for row in overlap["chunks"]], expected, rtol=1e-12)


def pooled_chunk_iou(pairs, num_chunks: int) -> float:
    """By definition, as a slow loop: cut both sides of each (student, teacher) encoding into
    `num_chunks` runs of tokens (chunk c holds tokens [floor(c n / N), floor((c + 1) n / N))),
    take each chunk's characters [first token's start, last token's end), and average the
    character IoU over every pair whose sides both hold tokens and whose student side holds
    characters."""
    ious = []
    for student, teacher in pairs:
        spans = []
        for enc in (student, teacher):
            cuts = [c * len(enc) // num_chunks for c in range(num_chunks + 1)]
            spans.append(
                [
                    (enc.start[a], enc.end[b - 1]) if b > a else None
                    for a, b in itertools.pairwise(cuts)
                ]
            )
        for s_span, t_span in zip(*spans, strict=True):
            if s_span is None or t_span is None or s_span[1] <= s_span[0]:
                continue
            inter = max(0, min(s_span[1], t_span[1]) - max(s_span[0], t_span[0]))
            union = (s_span[1] - s_span[0]) + (t_span[1] - t_span[0]) - inter
            ious.append(inter / union)
    return float(np.mean(ious))


def test_chunks_command_on_plain_json_lines(tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    texts = [doc.text for doc in itertools.islice(Corpus(str(TRAIN_CORPUS)), 3)]
    corpus.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    argv = ["analyze", "chunks", "--student-tokenizer", "tinyllama", "--teacher-tokenizer"]
    argv += ["deepseek", "--input", str(corpus), "--text-column", "body", "--num-docs", "10"]
    argv += ["--chunks", "4", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    saved = json.loads((tmp_path / "out" / "chunk_overlap.json").read_text())
    assert saved["documents"] == 3  # fewer documents than asked for: all of them, no error
    assert [row["num_chunks"] for row in saved["chunks"]] == [1, 4]
    assert "token-level" in capsys.readouterr().out


def test_chunks_on_a_corpus_with_a_bad_record(tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "Two plus two is four."}\n{"text": ""}\n{"text": "Five."}\n')
    argv = ["analyze", "chunks", "--student-tokenizer", "tinyllama", "--teacher-tokenizer"]
    argv += ["qwen2.5", "--input", str(corpus), "--chunks", "1", "2", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "record 1: empty or whitespace-only text" in capsys.readouterr().err

    assert main([*argv, "--on-bad-record", "skip"]) == 0
    saved = json.loads((tmp_path / "o" / "chunk_overlap.json").read_text())
    assert saved["documents"] == 2
    assert [(s["record"], s["reason"]) for s in saved["skipped"]] == [
        (1, "empty or whitespace-only text")
    ]
    assert "1 malformed records skipped" in (tmp_path / "o" / "chunk_overlap.md").read_text()


def test_chunks_options_from_a_manifest_with_the_command_line_winning(tmp_path):
    manifest = tmp_path / "analysis.toml"
    manifest.write_text(
        '[analyze]\nstudent-tokenizer = "tinyllama"\nteacher-tokenizer = "qwen2.5"\n'
        f'input = "{TRAIN_CORPUS}"\nnum-docs = 50\nchunks = [1, 8]\n'
    )
    out = tmp_path / "out"
    argv = ["analyze", "chunks", "--manifest", str(manifest), "--num-docs", "2", "--out", str(out)]
    assert main(argv) == 0
    saved = json.loads((out / "chunk_overlap.json").read_text())
    assert saved["documents"] == 2 and saved["config"]["teacher_tokenizer"] == "qwen2.5"
    assert [row["num_chunks"] for row in saved["chunks"]] == [1, 8]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--chunks", "0", "4"], "chunks must be at least 1"),
        (["--num-docs", "0"], "num_docs must be at least 1"),
        (["--input", "/nonexistent/corpus.jsonl"], "/nonexistent/corpus.jsonl"),
    ],
)
def test_chunks_command_rejects_bad_options(tmp_path, capsys, extra, message):
    argv = ["analyze", "chunks", "--student-tokenizer", "tinyllama", "--teacher-tokenizer"]
    argv += ["qwen2.5", "--input", str(TRAIN_CORPUS), "--out", str(tmp_path), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vocagno analyze: error:") and message in err
    assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing half-written


# --- curves -------------------------------------------------------------------------------------


def metrics_lines(steps: int, kept: float) -> list[str]:
    lines = []
    for step in range(1, steps + 1):
        loss_all = 3.0 / step**0.5
        record = {
            "step": step,
            "loss": loss_all * 0.8 if kept < 1 else loss_all,
            "loss_all": loss_all,
            "kept_fraction": kept,
            "mapped_fraction": 0.97,
            "tokens": 4096 * step,
            "lr": 1e-3,
        }
        lines.append(json.dumps(record) + "\n")
    return lines


def write_run(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(lines))
    return folder


def test_curves_of_a_finished_and_a_running_run(tmp_path, capsys):
    plain = write_run(tmp_path / "plain", metrics_lines(20, kept=1.0))
    guided_lines = metrics_lines(12, kept=0.6)
    guided = write_run(tmp_path / "guided", [*guided_lines[:-1], guided_lines[-1][:25]])

    assert read_metrics(plain).warning is None
    running = read_metrics(guided)
    assert running.steps == 11 and "unfinished last line 12" in running.warning
    assert list(running.columns["step"]) == list(range(1, 12))
    assert set(running.columns) == set(FIELDS)

    out = tmp_path / "figures" / "curves.png"
    assert main(["analyze", "curves", str(plain), str(guided), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "warning:" in captured.err and "guided" in captured.err
    assert "20 steps" in captured.out and "11 steps" in captured.out
    assert_png(out, "training_curves")


def test_curves_fingerprint_follows_the_metrics(tmp_path):
    run = write_run(tmp_path / "run", metrics_lines(5, kept=0.4))
    config = TrainingCurvesConfig(run_dirs=[run], out=tmp_path / "a.png")
    plot_training_curves(config)
    (run / "metrics.jsonl").write_text("".join(metrics_lines(6, kept=0.4)))
    plot_training_curves(TrainingCurvesConfig(run_dirs=[run], out=tmp_path / "b.png"))
    with Image.open(tmp_path / "a.png") as a, Image.open(tmp_path / "b.png") as b:
        assert a.info["Description"] != b.info["Description"]


def test_a_null_metric_is_a_gap_not_an_error(tmp_path):
    lines = metrics_lines(3, kept=0.5)
    record = json.loads(lines[1])
    record["loss"] = None
    lines[1] = json.dumps(record) + "\n"
    columns = read_metrics(write_run(tmp_path / "run", lines)).columns
    assert columns["loss"][0] > 0 and columns["loss"][1] != columns["loss"][1]  # NaN


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda lines: [lines[0], "{not json\n", *lines[1:]], "line 2 is not a JSON object"),
        (lambda lines: [lines[0], "[1, 2]\n", *lines[1:]], "line 2 is not a JSON object"),
        (lambda lines: [lines[0].replace('"lr"', '"rate"'), *lines[1:]], "line 1 lacks lr"),
        (lambda lines: [lines[0].replace('"tokens": 4096', '"tokens": "x"')], "not a number"),
    ],
)
def test_damaged_metrics_are_errors(tmp_path, damage, message):
    run = write_run(tmp_path / "run", damage(metrics_lines(4, kept=0.5)))
    with pytest.raises(VocagnoError, match=message):
        read_metrics(run)


def test_curves_command_on_a_missing_run(tmp_path, capsys):
    run = write_run(tmp_path / "run", metrics_lines(3, kept=0.5))
    missing = tmp_path / "no-such-run"
    out = tmp_path / "c.png"
    assert main(["analyze", "curves", str(run), str(missing), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"no metrics.jsonl in folder {missing}" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_curves_of_runs_that_have_not_logged_yet(tmp_path, capsys):
    run = write_run(tmp_path / "run", [])
    assert main(["analyze", "curves", str(run), "--out", str(tmp_path / "c.png")]) == 2
    assert "none of the runs has logged a step yet" in capsys.readouterr().err
