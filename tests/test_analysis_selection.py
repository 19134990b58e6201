"""vocagno analyze selection: its figures are the selection stage 2 makes, measured as the report
says (each computed here independently: a forward pass per document, a sort, loops, scipy)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from transformers import AutoModelForCausalLM

from apps.analysis.selection import SelectionSample, selection_statistics
from apps.cli import main
from pipeline.cache.manifest import load_manifest
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.tokenizer import load_tokenizer
from stage2_train.data.plan import DataPlan
from stage2_train.data.streams import consumer_stream
from tests.cache_fixtures import build_cache, corpus_documents
from tests.stage1_helpers import make_tiny_teacher


def expected_statistics(sample: SelectionSample, min_count: int, max_rate: float) -> dict:
    """The report's definitions, token by token."""
    loss, teacher = sample.student_loss.astype(float), sample.teacher_loss.astype(float)
    mapped = ~np.isnan(teacher)
    excess = loss - teacher
    by_type: dict[int, list[int]] = {}
    for i, token in enumerate(sample.token_id.tolist()):
        by_type.setdefault(token, []).append(i)
    seldom = {
        token: where
        for token, where in by_type.items()
        if len(where) >= min_count and sum(sample.kept[i] for i in where) <= max_rate * len(where)
    }
    seldom_tokens = [i for where in seldom.values() for i in where]
    return {
        "kept_loss_share": sum(loss[i] for i in range(len(loss)) if sample.kept[i]) / loss.sum(),
        "random_loss_share": sum(loss[sample.random_kept]) / loss.sum(),
        "excess_vs_student_loss": spearmanr(excess[mapped], loss[mapped]).statistic,
        "excess_vs_minus_teacher_loss": spearmanr(excess[mapped], -teacher[mapped]).statistic,
        "types": len(seldom),
        "token_share": len(seldom_tokens) / len(loss),
        "loss_share": sum(loss[i] for i in seldom_tokens) / loss.sum(),
        "order": sorted(seldom, key=lambda token: (-len(seldom[token]), token)),
    }


def assert_matches(statistics: dict, expected: dict, rank_tolerance: float = 1e-9) -> None:
    """`rank_tolerance`: float32 and float64 losses may order near-ties differently."""
    for name in ("kept_loss_share", "random_loss_share"):
        assert statistics[name] == pytest.approx(expected[name], rel=1e-6), name
    for name in ("excess_vs_student_loss", "excess_vs_minus_teacher_loss"):
        assert statistics[name] == pytest.approx(expected[name], abs=rank_tolerance), name
    seldom = statistics["seldom_kept"]
    assert seldom["types"] == expected["types"]
    assert seldom["token_share"] == pytest.approx(expected["token_share"])
    assert seldom["loss_share"] == pytest.approx(expected["loss_share"])
    listed = [row["token_id"] for row in seldom["most_frequent"]]
    assert listed == expected["order"][: len(listed)]


def test_statistics_follow_their_definitions_with_ties_and_unmapped_tokens():
    rng = np.random.default_rng(3)
    n = 4000
    token_id = (rng.zipf(1.6, n) - 1) % 60  # frequent and rare types; 0 the most frequent
    student = np.round(rng.gamma(2.0, 1.5, n), 1).astype(np.float32)  # rounded: many ties
    teacher = np.round(rng.gamma(1.5, 1.0, n), 1).astype(np.float32)
    teacher[rng.random(n) < 0.1] = np.nan
    # kept: high excess among the mapped, with type 0 never kept (a frequent type left out)
    excess = np.where(np.isnan(teacher), -np.inf, student - teacher)
    kept = (excess > np.quantile(excess[np.isfinite(excess)], 0.6)) | np.isnan(teacher)
    kept &= token_id != 0
    random_kept = rng.random(n) < kept.mean()
    sample = SelectionSample(token_id, student, teacher, kept, random_kept)
    statistics = selection_statistics(sample, min_count=20, max_kept_rate=0.05, top=5)
    expected = expected_statistics(sample, 20, 0.05)
    assert_matches(statistics, expected)
    assert expected["types"] >= 1 and 0 in expected["order"]  # the rule is exercised
    assert statistics["kept_loss_share"] > statistics["random_loss_share"]


def test_a_constant_side_has_no_rank_correlation():
    sample = SelectionSample(
        np.zeros(5, np.int64), np.ones(5, np.float32), np.ones(5, np.float32),
        np.zeros(5, bool), np.zeros(5, bool),
    )  # fmt: skip
    statistics = selection_statistics(sample, 1, 0.5, 3)
    assert statistics["excess_vs_student_loss"] is None


@pytest.fixture(scope="module")
def cache_and_student(tmp_path_factory):
    root = tmp_path_factory.mktemp("selection")
    build_cache(root / "cache", teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=4)
    student = make_tiny_teacher(root / "student", "tinyllama")  # any causal LM serves as student
    return root / "cache", student


def independent_sample(cache, student, seq_len: int, rows: int, topk: float) -> SelectionSample:
    """Stage 2's first micro-batch of the cache (its data path: packing, alignment, teacher
    loss), each packed document scored by the student alone, and eq. 4 by a sort."""
    tokenizer = load_tokenizer("tinyllama")
    plan = DataPlan.from_cache(
        cache, student_tokenizer=tokenizer.spec, seq_len=seq_len, micro_batch_size=rows
    )
    batch = next(iter(consumer_stream(plan, 0)))
    model = AutoModelForCausalLM.from_pretrained(student).eval()
    labels, segments = batch["labels"], batch["segment_ids"]
    loss = torch.full(labels.shape, float("nan"), dtype=torch.float64)
    for row in range(rows):
        for segment in segments[row].unique().tolist():
            if segment == 0:
                continue
            where = segments[row] == segment
            with torch.inference_mode():
                logits = model(input_ids=batch["input_ids"][row][where][None]).logits[0]
            target = labels[row][where]
            trained = target != IGNORE_INDEX
            loss[row, where.nonzero().squeeze(1)[trained]] = torch.nn.functional.cross_entropy(
                logits[trained].double(), target[trained], reduction="none"
            )
    valid = labels != IGNORE_INDEX
    student_loss = loss[valid].numpy()
    teacher = batch["teacher_loss"][valid].numpy()
    mapped = ~np.isnan(teacher)
    candidates = np.flatnonzero(mapped)
    ranked = candidates[np.argsort(-(student_loss - teacher)[candidates], kind="stable")]
    top = math.ceil(round(topk * len(candidates), 9))
    kept = ~mapped
    kept[ranked[:top]] = True
    return SelectionSample(labels[valid].numpy(), student_loss, teacher, kept, kept)


def test_the_command_reports_stage_2s_first_micro_batch_as_measured_independently(
    cache_and_student, tmp_path, capsys
):
    cache, student = cache_and_student
    out = tmp_path / "report"
    args = [
        "analyze", "selection", "--cache", str(cache), "--student", str(student),
        "--student-tokenizer", "tinyllama", "--tokens", "1", "--seq-len", "256",
        "--micro-batch-size", "4", "--min-count", "3", "--max-kept-rate", "0.2",
        "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "selection.json").read_text())
    statistics = report["statistics"]
    sample = independent_sample(cache, student, seq_len=256, rows=4, topk=0.4)
    expected = expected_statistics(sample, 3, 0.2)
    assert statistics["tokens"] == len(sample.token_id)
    assert statistics["kept_fraction"] == pytest.approx(sample.kept.mean())
    # the random control keeps as many tokens as the selection, and other ones
    assert statistics["random_kept_fraction"] == pytest.approx(statistics["kept_fraction"])
    assert statistics["random_loss_share"] != pytest.approx(statistics["kept_loss_share"])
    expected["random_loss_share"] = statistics["random_loss_share"]
    assert_matches(statistics, expected, rank_tolerance=1e-3)
    assert 0 < expected["types"] and 0 < len(sample.token_id) - sample.kept.sum()
    assert report["resolved"]["guidance"]["topk"] == 0.4
    assert report["resolved"]["cache_fingerprint"]
    assert report["resolved"]["teacher"] == load_manifest(cache).teacher
    printed = capsys.readouterr().out
    assert f"kept tokens carry {statistics['kept_loss_share']:.1%}" in printed
    assert "| token | count |" in (out / "selection.md").read_text()


def test_a_missing_student_is_one_line(cache_and_student, tmp_path, capsys):
    cache, _ = cache_and_student
    args = ["analyze", "selection", "--cache", str(cache), "--student", str(tmp_path / "none"),
            "--student-tokenizer", "tinyllama", "--out", str(tmp_path / "r")]  # fmt: skip
    assert main(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"student '{tmp_path / 'none'}' is not a preset" in err[0], err


def _vocagno_folder(student: Path, dest: Path) -> Path:
    """A copy of `student` recording its files' digests in a vocagno.json, as final/ does."""
    from pipeline.file_digests import DIGEST, digest_share, folder_files
    from pipeline.models.model_folder import PROVENANCE_NAME

    shutil.copytree(student, dest)
    files = digest_share(dest, folder_files(dest, leave_out=PROVENANCE_NAME), 0, 1)
    (dest / PROVENANCE_NAME).write_text(json.dumps({"digest": DIGEST, "files": files}))
    return dest


def test_both_readers_of_a_student_refuse_a_damaged_folder_and_a_checkpoint(
    cache_and_student, tmp_path, capsys
):
    """`analyze selection --student` and `cache inspect --student` load through the loader
    stage 2 uses (its digests and header checks first). Before: a final/ with flipped bytes gave
    numbers, and a stage-2 checkpoint folder a transformers traceback."""
    cache, student = cache_and_student
    damaged = _vocagno_folder(student, tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    checkpoint = tmp_path / "step-2"  # what a stage-2 checkpoint holds beside its state/
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"student": "llama-tiny", "seed": 0}))
    commands = {
        "selection": ["analyze", "selection", "--cache", str(cache), "--student-tokenizer",
                      "tinyllama", "--out", str(tmp_path / "r"), "--student"],
        "inspect": ["cache", "inspect", str(cache), "--student-tokenizer", "tinyllama", "--out",
                    str(tmp_path / "page.html"), "--student"],
    }  # fmt: skip
    for command in commands.values():
        for folder, said in ((damaged, f"{weights} does not match its recorded digest"),
                             (checkpoint, "is not a model's configuration")):  # fmt: skip
            assert main([*command, str(folder)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and said in err[0], err
    assert not (tmp_path / "r").exists() and not (tmp_path / "page.html").exists()


def test_the_selection_of_several_teachers_is_stage_2s(cache_and_student, tmp_path):
    """With --more-caches the diagnostic ranks by the combined teacher loss stage 2 trains on:
    one teacher twice reports what that teacher does alone; another teacher changes it, and the
    report names both."""
    cache, student = cache_and_student
    shutil.copytree(cache, tmp_path / "copy")
    build_cache(tmp_path / "other", teacher_tokenizer="smollm2", documents=corpus_documents(8),
                docs_per_shard=4, seed=3)  # fmt: skip
    reports = {}
    for name, more in (("one", []), ("twice", ["copy"]), ("two", ["other"])):
        extra = ["--more-caches", *(str(tmp_path / m) for m in more)] if more else []
        args = ["analyze", "selection", "--cache", str(cache), "--student", str(student),
                "--student-tokenizer", "tinyllama", "--tokens", "1", "--seq-len", "256",
                "--micro-batch-size", "4", "--out", str(tmp_path / name), *extra]  # fmt: skip
        assert main(args) == 0
        reports[name] = json.loads((tmp_path / name / "selection.json").read_text())
    assert reports["twice"]["statistics"] == reports["one"]["statistics"]
    assert reports["two"]["statistics"] != reports["one"]["statistics"]
    assert reports["two"]["resolved"]["more_teachers"] == [load_manifest(tmp_path / "other").teacher]
