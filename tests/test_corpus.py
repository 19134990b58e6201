"""Corpus readers: every format streams the same documents; every bad record is named or skipped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pipeline.cache.manifest import SkippedDocument
from pipeline.corpus import Corpus, CorpusOptions, Document
from pipeline.errors import CorpusError
from pipeline.shipped import shipped_corpus

ROWS = [
    {"id": "a", "text": "First document.\nWith two lines."},
    {"id": "b", "text": "Second: 12 + 30 = 42"},
    {"id": "c", "text": "Third, with ünïcödé and 数字 3."},
]


def write_jsonl(path: Path, rows: list, compress: bool = False) -> Path:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if compress else data)
    return path


def documents(spec, **options) -> list:
    return list(Corpus(spec, CorpusOptions(**options)))


def texts(items) -> list[str]:
    return [d.text for d in items]


def test_jsonl_plain_and_zstd_stream_the_same_documents(tmp_path):
    plain = documents(write_jsonl(tmp_path / "c.jsonl", ROWS))
    packed = documents(write_jsonl(tmp_path / "c.jsonl.zst", ROWS, compress=True))
    assert texts(plain) == texts(packed) == [r["text"] for r in ROWS]
    assert [d.doc_id for d in plain] == ["c.jsonl:0", "c.jsonl:1", "c.jsonl:2"]
    assert [d.doc_id for d in packed] == ["c.jsonl.zst:0", "c.jsonl.zst:1", "c.jsonl.zst:2"]


def test_id_column_and_blank_lines_keep_record_numbers(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    docs = documents(path, id_column="id")
    assert [(d.doc_id, d.record) for d in docs] == [("a", 0), ("b", 2)]


def test_shipped_corpus_streams_with_its_ids():
    corpus = Corpus(
        shipped_corpus("eval"),
        CorpusOptions(id_column="id"),
    )
    docs = list(corpus)
    assert len(docs) == 1000 and len({d.doc_id for d in docs}) == 1000
    assert docs[0].text.startswith("Question:") and corpus.fraction_read() == 1.0


def test_parquet_streams_row_groups_and_reports_progress(tmp_path):
    rows = [{"id": f"d{i}", "text": f"document number {i}"} for i in range(2500)]
    path = tmp_path / "part.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1000)
    corpus = Corpus(path, CorpusOptions(id_column="id"))
    seen = []
    for doc in corpus:
        seen.append((doc.doc_id, doc.text, corpus.fraction_read()))
    assert [s[:2] for s in seen] == [(r["id"], r["text"]) for r in rows]
    assert 0 < seen[0][2] < 1 and seen[-1][2] == 1.0


def test_parquet_binary_text_column_is_decoded(tmp_path):
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": pa.array([b"caf\xc3\xa9"], pa.binary())}), path)
    assert texts(documents(path, text_column="body")) == ["café"]


def test_missing_text_column_lists_the_columns(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    with pytest.raises(
        CorpusError, match=r"t.parquet: no column 'body'; the columns are: id, text"
    ):
        documents(path, text_column="body")


def test_missing_text_field_in_json_lines_lists_the_fields(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "x", "content": "hello"}])
    with pytest.raises(
        CorpusError, match=r"c.jsonl: record 0: no field 'text' \(fields: 'content', 'id'\)"
    ):
        documents(path)


def test_a_hub_dataset_streams_through_datasets_and_names_its_columns(tmp_path, monkeypatch):
    """`hf:NAME` streams with the `datasets` library, which takes a local folder for NAME as it
    would a hub id (no network here): the documents in order with their ids, and a text column
    the dataset lacks is one line that lists the columns it has."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "hub"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"id": r["id"], "body": r["text"]} for r in ROWS])
    docs = documents(f"hf:{folder}", text_column="body", id_column="id")
    assert [(d.doc_id, d.text) for d in docs] == [(r["id"], r["text"]) for r in ROWS]
    said = f"hub dataset {folder}: no column 'text'; the columns are: id, body"
    with pytest.raises(CorpusError, match=f"^{re.escape(said)}$"):
        documents(f"hf:{folder}")


def test_text_files_one_document_per_file_or_per_line(tmp_path):
    folder = tmp_path / "books"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "two.txt").write_text("line one\r\n\r\nline three\n")
    (folder / "a.md").write_text("# Title\n\nbody\n")
    (folder / "skip.bin").write_bytes(b"\x00")  # not a corpus format: ignored in a folder
    per_file = documents(folder)
    assert [(d.doc_id, d.text) for d in per_file] == [
        ("a.md:0", "# Title\n\nbody\n"),
        ("b/two.txt:0", "line one\r\n\r\nline three\n"),
    ]
    per_line = documents(folder, text_split="line")
    assert [(d.doc_id, d.text) for d in per_line] == [
        ("a.md:0", "# Title"),
        ("a.md:2", "body"),
        ("b/two.txt:0", "line one"),
        ("b/two.txt:2", "line three"),
    ]


def test_glob_pattern_names_files_relative_to_its_folder(tmp_path):
    write_jsonl(tmp_path / "p1.jsonl", ROWS[:1])
    write_jsonl(tmp_path / "p0.jsonl.zst", ROWS[1:], compress=True)
    docs = documents(str(tmp_path / "p*.jsonl*"))
    assert [d.doc_id for d in docs] == ["p0.jsonl.zst:0", "p0.jsonl.zst:1", "p1.jsonl:0"]


def test_saved_datasets_dataset_and_dataset_dict(tmp_path):
    import datasets

    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    assert texts(documents(single)) == [r["text"] for r in ROWS]
    assert [d.doc_id for d in documents(single)] == ["single:0", "single:1", "single:2"]
    both = tmp_path / "both"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(both))
    docs = documents(both, split="test", id_column="id")
    assert [(d.doc_id, d.source) for d in docs] == [("a", "both/test")]
    with pytest.raises(CorpusError, match="no split 'dev'; its splits are: train, test"):
        documents(both, split="dev")


def test_nonexistent_path_and_empty_folder(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        Corpus(tmp_path / "nope.jsonl")
    with pytest.raises(CorpusError, match="holds no supported files"):
        Corpus(tmp_path)
    with pytest.raises(CorpusError, match="matches no files"):
        Corpus(str(tmp_path / "*.parquet"))


BAD_JSONL_LINES = [
    (b'{"id": "e", "text": ""}', "empty or whitespace-only text"),
    (b'{"id": "w", "text": " \\n\\t\\u3000"}', "empty or whitespace-only text"),
    (b'{"id": "n", "text": null}', "null text"),
    (b'{"id": "u", "text": "caf\xe9"}', "invalid UTF-8 at byte 24"),
    (b'{"id": "j", "text": "unterminated', "not valid JSON"),
    (b'["a list"]', "a JSON list, not an object"),
    (b'{"id": "i", "text": 7}', "text is an int, not a string"),
    (b'{"id": null, "text": "no id"}', "null or empty id"),
    # Valid JSON, but no UTF-8 spelling: neither a tokenizer nor Parquet can take it.
    (b'{"id": "s", "text": "x\\ud800y"}', "text holds a lone surrogate U\\+D800 at character 1"),
    (b'{"id": "\\udc00", "text": "t"}', "id holds a lone surrogate U\\+DC00 at character 0"),
    (b'{"id": "a", "text": "again"}', "duplicate document id 'a' \\(first at c.jsonl record 0\\)"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_JSONL_LINES)
def test_each_bad_record_is_an_error_naming_file_and_record(tmp_path, line, reason):
    path = tmp_path / "c.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + line + b"\n")
    with pytest.raises(CorpusError, match=rf"c.jsonl: record 1: {reason}"):
        documents(path, id_column="id")


def test_skip_mode_records_every_bad_record_and_keeps_going(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps(ROWS[0]).encode()] + [line for line, _ in BAD_JSONL_LINES]
    lines.append(json.dumps(ROWS[1]).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    items = documents(path, id_column="id", on_bad_record="skip")
    assert [d.doc_id for d in items if isinstance(d, Document)] == ["a", "b"]
    skipped = [s for s in items if isinstance(s, SkippedDocument)]
    assert [s.record for s in skipped] == list(range(1, len(BAD_JSONL_LINES) + 1))
    assert all(s.source == "c.jsonl" and s.reason for s in skipped)
    assert skipped[0].doc_id == "e" and skipped[-1].doc_id == "a"


def test_a_utf8_byte_order_mark_at_the_start_of_a_file_is_not_text(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "c.jsonl").write_bytes(bom + b'{"text": "first"}\n{"text": "\xef\xbb\xbfkept"}\n')
    # Only the file's own mark goes: one inside a document is that document's text.
    assert [d.text for d in documents(tmp_path / "c.jsonl")] == ["first", "\ufeffkept"]
    (tmp_path / "t.txt").write_bytes(bom + b"line one\nline two\n")
    assert [d.text for d in documents(tmp_path / "t.txt", text_split="line")] == [
        "line one",
        "line two",
    ]
    assert [d.text for d in documents(tmp_path / "t.txt")] == ["line one\nline two\n"]


def test_invalid_utf8_in_text_files_and_parquet_strings(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok line\n\xff\xfe broken\n")
    items = documents(tmp_path / "bad.txt", text_split="line", on_bad_record="skip")
    assert isinstance(items[0], Document) and items[1].reason == "invalid UTF-8 at byte 0"
    # Arrow does not validate strings read from Parquet: a bad one must still be caught.
    broken = pa.array([b"fine", b"\xc3("], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": broken}), tmp_path / "bad.parquet")
    with pytest.raises(CorpusError, match=r"bad.parquet: record 1: invalid UTF-8 at byte 0"):
        documents(tmp_path / "bad.parquet")


def test_description_changes_with_the_files(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", ROWS)
    before = Corpus(path).describe()
    assert before == Corpus(path).describe()
    write_jsonl(path, ROWS[:2])
    assert Corpus(path).describe() != before
    assert Corpus(path, CorpusOptions(text_column="body")).describe() != Corpus(path).describe()


def test_max_docs_reads_the_first_records_and_is_part_of_the_identity_only_when_given(tmp_path):
    rows = [{"text": f"document {i}"} for i in range(5)]
    rows[1] = {"text": " "}  # a bad record counts toward the slice
    path = write_jsonl(tmp_path / "docs.jsonl", rows)
    whole = Corpus(path, CorpusOptions(on_bad_record="skip"))
    sliced = Corpus(path, CorpusOptions(on_bad_record="skip", max_docs=3))
    items = list(sliced)
    assert [type(item) for item in items] == [Document, SkippedDocument, Document]
    assert [item.text for item in items if isinstance(item, Document)] == ["document 0",
                                                                            "document 2"]  # fmt: skip
    assert sliced.fraction_read() == 1.0
    assert "max_docs" not in whole.describe()
    assert sliced.describe() == {**whole.describe(), "max_docs": 3}
    assert len([item for item in Corpus(path, CorpusOptions(max_docs=99, on_bad_record="skip"))]) == 5
    with pytest.raises(ValueError, match="max_docs must be at least 1"):
        CorpusOptions(max_docs=0)
