"""Bad and awkward input in both stages, where no other test covers it (the full table, with the
tests that cover the rest, is in docs/bad-input.md):

- texts a tokenizer normalizes (ligatures, full-width digits, combining marks) and control
  characters (NUL, ESC, zero-width space): stage 1 scores them with offsets inside the original
  text and a verified cache; stage 2 puts each cached teacher loss on exactly the student tokens
  that share characters with it;
- a corrupt manifest (truncated, edited, missing) and a shard missing a column: stage 2 and
  `vocagno cache verify` stop with one line, no traceback, exit 2;
- a cache from another teacher: stage 1 refuses to mix into it, naming what differs.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from apps.cli import main as vocagno
from pipeline.cache.manifest import MANIFEST_NAME, ShardRecord, load_manifest, write_manifest
from pipeline.cache.schema import TOKEN_END, shard_name, write_shard
from pipeline.cache.verify import verify_cache
from pipeline.errors import CacheError
from pipeline.tokenizer import load_tokenizer
from stage1_score.output import prepare_output
from stage2_train.train import main as train
from tests.cache_fixtures import build_cache, read_cache_rows
from tests.stage1_helpers import direct_losses, make_tiny_teacher
from tests.stage2_runs import train_args
from tests.test_stage1_hf_backend import score
from tests.test_stage2_data import annotate_rows, first_batches, make_plan, overlap_oracle

AWKWARD_TEXTS = {
    "ligatures": "ﬁnd the ﬁle, ﬂoor and oﬀice",
    "full-width digits": "１２３ + ４５６ = ５７９ apples",
    "combining marks": "e\u0301cole nai\u0308ve Ame\u0301lie 한국어",
    "NUL": "before\x00after, 3 + 4 = 7",
    "ESC sequence": "\x1b[31mred\x1b[0m text and 12 pens",
    "zero-width space": "zero\u200bwidth\u200bjoined 42 items",
    "mixed": "ﬁ１\u0301\x00\x1b\u200b end",
}


@pytest.fixture(scope="module")
def awkward_cache(tmp_path_factory):
    """The awkward texts in a cache built with the real qwen2.5 tokenizer's offsets."""
    path = tmp_path_factory.mktemp("awkward")
    build_cache(path, documents=list(AWKWARD_TEXTS.items()), docs_per_shard=4)
    return path


def test_stage1_scores_awkward_texts_with_offsets_inside_the_original(tmp_path):
    """The real HF backend on a tiny teacher: every token after the first is scored, equal to a
    direct forward pass, and every span lies inside the text as given (not as normalized)."""
    teacher = make_tiny_teacher(tmp_path / "teacher", "tinyllama")
    texts = list(AWKWARD_TEXTS.values())
    scorer, ids, losses = score(teacher, texts)
    tokenizer = load_tokenizer(str(teacher))
    for text, token_ids, loss in zip(texts, ids, losses, strict=True):
        encoding = tokenizer.encode(text)
        assert (encoding.start <= encoding.end).all() and encoding.end.max() <= len(text)
        assert np.isfinite(loss[1:]).all()
        np.testing.assert_allclose(loss, direct_losses(scorer.model, token_ids), atol=1e-4)


def test_a_cache_of_awkward_texts_verifies(awkward_cache):
    manifest, problems = verify_cache(awkward_cache)
    assert problems == [] and manifest.total_rows == len(AWKWARD_TEXTS)


@pytest.mark.parametrize("student", ["tinyllama", "smollm2"])
def test_stage2_aligns_awkward_texts_by_characters(awkward_cache, student):
    rows = list(read_cache_rows(awkward_cache).values())
    docs = annotate_rows(rows, student, aggregate="max")
    tokenizer = load_tokenizer(student)
    offset = 0
    for row, length in zip(rows, docs.lengths, strict=True):
        enc = tokenizer.encode(row["text"], add_eos=True)
        np.testing.assert_allclose(
            docs.teacher_loss[offset : offset + length], overlap_oracle(enc, row, "max"), rtol=1e-6
        )
        assert np.isfinite(docs.teacher_loss[offset : offset + length]).any(), row["doc_id"]
        offset += length

    # The packed stream carries the same losses: rebuild it from the documents each micro-batch
    # lists (a document is listed where its first token is consumed) with the oracle's losses.
    plan = make_plan(awkward_cache, student_tokenizer=student, seq_len=16)
    batches = first_batches(plan, 5)  # the fifth lists any document the fourth's labels reach
    by_id = {row["doc_id"]: row for row in rows}
    listed = [doc_id for batch in batches for _, doc_id in batch["documents"]]
    assert {doc_id for batch in batches[:4] for _, doc_id in batch["documents"]} == set(by_id)
    encodings = [tokenizer.encode(by_id[doc_id]["text"], add_eos=True) for doc_id in listed]
    stream_ids = np.concatenate([enc.ids for enc in encodings])
    stream_loss = np.concatenate(
        [overlap_oracle(enc, by_id[d], "max") for enc, d in zip(encodings, listed, strict=True)]
    )
    width = plan.micro_batch_size * plan.seq_len
    for k, batch in enumerate(batches[:4]):
        for b in range(plan.micro_batch_size):
            first = k * width + b * plan.seq_len
            targets = slice(first + 1, first + plan.seq_len + 1)
            np.testing.assert_array_equal(
                batch["input_ids"][b], stream_ids[first : first + plan.seq_len]
            )
            np.testing.assert_array_equal(batch["labels"][b], stream_ids[targets])
            np.testing.assert_allclose(batch["teacher_loss"][b], stream_loss[targets], rtol=1e-6)


def one_line(capsys, prefix: str) -> str:
    captured = capsys.readouterr()
    text = (captured.out + captured.err).strip()
    assert "Traceback" not in text and "\n" not in text, text
    assert text.startswith(prefix), text
    return text


def edit_teacher_id(cache):
    data = json.loads((cache / MANIFEST_NAME).read_text())
    data["teacher"]["id"] = "someone-else/teacher"  # valid JSON, stale fingerprint
    (cache / MANIFEST_NAME).write_text(json.dumps(data))


def truncate(cache):
    path = cache / MANIFEST_NAME
    path.write_text(path.read_text()[:50])


def edit_first_shard(**changes):
    """A hostile manifest: shard entries are outside the producer fingerprint, so only the
    per-record checks stand between them and a path or a count the readers would use."""

    def damage(cache):
        data = json.loads((cache / MANIFEST_NAME).read_text())
        data["shards"][0].update(changes)
        (cache / MANIFEST_NAME).write_text(json.dumps(data))

    return damage


def list_first_shard_twice(cache):
    data = json.loads((cache / MANIFEST_NAME).read_text())
    data["shards"].append(data["shards"][0])
    (cache / MANIFEST_NAME).write_text(json.dumps(data))


CORRUPT_MANIFESTS = [
    (truncate, "is not valid JSON"),
    (edit_teacher_id, "the manifest was edited or corrupted"),
    (lambda cache: (cache / MANIFEST_NAME).unlink(), "manifest.json"),
    (edit_first_shard(file="../../outside.parquet"), "is named '../../outside.parquet'"),
    (edit_first_shard(file="/etc/passwd"), "is named '/etc/passwd'"),
    (edit_first_shard(rows=-4), "rows -4 is not a count"),
    (edit_first_shard(bytes=10**30), "is not a count"),
    (edit_first_shard(teacher_tokens="12"), "teacher_tokens '12' is not a count"),
    (edit_first_shard(index=True), "shard index True"),
    (edit_first_shard(sha256="../x"), "is not a SHA-256 digest"),
    (list_first_shard_twice, "a shard index is listed twice"),
]


@pytest.mark.parametrize(("damage", "message"), CORRUPT_MANIFESTS)
def test_a_corrupt_manifest_stops_both_readers_with_one_line(tmp_path, capsys, damage, message):
    cache = tmp_path / "cache"
    build_cache(cache, num_documents=4, docs_per_shard=4)
    damage(cache)
    capsys.readouterr()
    assert vocagno(["cache", "verify", str(cache)]) == 2
    assert message in one_line(capsys, "vocagno cache: error:")
    assert train(train_args(cache, tmp_path / "out")) == 2
    assert message in one_line(capsys, "stage2_train/train.py: error:")


def test_a_cache_that_is_a_file_is_named_as_one(tmp_path, capsys):
    (tmp_path / "cache.parquet").write_bytes(b"not a folder")
    assert vocagno(["cache", "verify", str(tmp_path / "cache.parquet")]) == 2
    assert "cache.parquet is a file; give the cache folder" in one_line(capsys, "vocagno cache")
    assert train(train_args(tmp_path / "cache.parquet", tmp_path / "out")) == 2
    assert "is a file" in one_line(capsys, "stage2_train/train.py: error:")


def test_an_output_path_the_system_refuses_is_one_line_naming_it(tmp_path, capsys):
    # Tests run as root, where permissions do not bite; a file where a folder must be does.
    cache = tmp_path / "cache"
    build_cache(cache, num_documents=4, docs_per_shard=4)
    (tmp_path / "taken").write_text("a file")
    capsys.readouterr()
    assert train(train_args(cache, tmp_path / "taken" / "out")) == 2
    line = one_line(capsys, "stage2_train/train.py: error:")
    assert str(tmp_path / "taken") in line and "Not a directory" in line


def test_a_shard_missing_a_column_is_refused_by_stage2(tmp_path, capsys):
    cache = tmp_path / "cache"
    build_cache(cache, num_documents=4, docs_per_shard=4)
    path = cache / shard_name(0)
    size, digest = write_shard(path, pq.read_table(path).drop_columns([TOKEN_END]), {"shard": 0})
    manifest = load_manifest(cache)
    manifest.shards = [
        ShardRecord(0, shard_name(0), 4, manifest.shards[0].teacher_tokens, size, digest)
    ]
    write_manifest(cache, manifest)  # checksums match: only the missing column is wrong
    with pytest.raises(CacheError, match=r"lacks columns \['token_end'\]"):
        first_batches(make_plan(cache))
    assert vocagno(["cache", "verify", str(cache)]) == 1
    assert "token_end" in capsys.readouterr().out


def test_stage1_refuses_to_mix_into_another_teachers_cache(tmp_path):
    cache = tmp_path / "cache"
    build_cache(cache, num_documents=4, docs_per_shard=4, teacher={"id": "teacher-a"})
    other = load_manifest(cache).producer | {"teacher": {"id": "teacher-b"}}
    with pytest.raises(CacheError, match=r"teacher\.id: \"teacher-a\" -> \"teacher-b\""):
        prepare_output(cache, other, overwrite=False, log=lambda _: None)
    assert load_manifest(cache).teacher == {"id": "teacher-a"}  # untouched


def test_a_float16_top_k_cache_under_the_compact_default_is_told_how_to_resume(tmp_path):
    """A top-k cache made before the compact encoding (float16, its settings without the key)
    meets a rerun under the new default: refused, naming the one flag that resumes it; a run
    that differs in more than the encoding gets no such hint."""
    cache = tmp_path / "cache"
    build_cache(cache, num_documents=4, docs_per_shard=4, topk=8)
    made = load_manifest(cache).producer
    compact = made | {"settings": made["settings"] | {"topk_encoding": "compact"}}
    with pytest.raises(CacheError, match=r"\(--topk-encoding float16 resumes it\)$"):
        prepare_output(cache, compact, overwrite=False, log=lambda _: None)
    other = compact | {"teacher": {"id": "teacher-b"}}
    with pytest.raises(CacheError, match=r"choose another --out$"):
        prepare_output(cache, other, overwrite=False, log=lambda _: None)
    assert prepare_output(cache, made, overwrite=False, log=lambda _: None)  # resumed


def test_a_uri_that_carries_credentials_is_refused_masked_and_nothing_is_written(
    tmp_path, capsys, monkeypatch
):
    """Before: `s3://KEY:SECRET@bucket/...` got as far as pyarrow, whose traceback's last line
    printed the secret. Every location (a flag, a manifest value, a command's argument) that
    carries credentials is refused in one line showing it masked; nothing is written."""
    from stage1_score.run import main as stage1

    monkeypatch.chdir(tmp_path)
    uri = "s3://AKIAEXAMPLE:SeCrEt@bucket/prefix"
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[stage2]\ncache = "{uri}"\n')
    runs = {
        "stage 2 flag": lambda: train(train_args(uri, tmp_path / "out")),
        "stage 2 manifest": lambda: train(["--manifest", str(manifest), *train_args(
            tmp_path / "c", tmp_path / "out")[2:]]),  # fmt: skip
        "stage 1": lambda: stage1(["--teacher", "t", "--corpus", uri, "--out", "o"]),
        "more caches": lambda: train(train_args(tmp_path / "c", tmp_path / "out", "--more-caches",
                                                uri)),  # fmt: skip
    }
    for name, run in runs.items():
        assert run() == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "s3://***@bucket/prefix carries credentials" in err[0], err
        assert "SeCrEt" not in err[0]
    with pytest.raises(SystemExit) as exit:
        vocagno(["cache", "verify", uri])
    assert exit.value.code == 2
    said = capsys.readouterr()
    assert "s3://***@bucket/prefix carries credentials" in said.err
    assert not any("SeCrEt" in text for text in (said.out, said.err))
    assert [path.name for path in tmp_path.iterdir()] == ["m.toml"]
