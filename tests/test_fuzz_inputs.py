"""Generated bad input at every reader a user feeds directly: corpora for stage 1's readers (any
Unicode including lone surrogates and controls, random JSON shapes, byte-order marks, line endings,
nulls, invalid bytes), texts for `vocagno align`, and hostile manifests for the cache readers.
The promise each test checks: a result, or our own one-line error, never a foreign exception.

Each property runs at a small size in the default suite and at a large one under `slow`. The small
runs draw the same examples on every machine (derandomized), so that the default suite passes or
fails by the code, not by the draw; the slow runs draw new ones each time, to find what no one
wrote down. A case one of them found is kept as an explicit example of the small run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from apps.cli import main as vocagno
from pipeline.cache.manifest import MANIFEST_NAME, SkippedDocument, load_manifest
from pipeline.corpus import Corpus, CorpusOptions, Document
from pipeline.errors import CacheError, CorpusError
from pipeline.tokenizer import load_tokenizer
from tests.cache_fixtures import build_cache

FAST, THOROUGH = 40, 600
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Every code point, lone surrogates and controls included.
any_text = st.text(alphabet=st.characters(codec=None), max_size=40)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=6,
)
record = st.one_of(
    st.fixed_dictionaries({"text": json_value}, optional={"id": json_value}),
    json_value,
)


def _encode_line(value, raw: bytes | None) -> bytes:
    # json.dumps writes lone surrogates as \\udXXX escapes: valid JSON, not encodable text.
    return raw if raw is not None else json.dumps(value).encode("ascii")


corpus_file = st.tuples(
    st.lists(st.tuples(record, st.none() | st.binary(max_size=20)), max_size=8),
    st.booleans(),  # a UTF-8 byte-order mark at the start
    st.sampled_from([b"\n", b"\r\n"]),
)


def check_corpus_file(tmp_path, generated, on_bad_record: str) -> None:
    rows, bom, newline = generated
    path = tmp_path / "corpus.jsonl"
    body = newline.join(_encode_line(value, raw) for value, raw in rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + body + newline)
    try:
        items = list(Corpus(path, CorpusOptions(id_column=None, on_bad_record=on_bad_record)))
    except CorpusError as exc:
        assert on_bad_record == "error" and "\n" not in str(exc)
        return
    for item in items:
        assert isinstance(item, Document | SkippedDocument)
        if isinstance(item, Document):
            item.text.encode("utf-8")  # what stage 1 stores must have a UTF-8 spelling
            assert item.text.strip()


@settings(max_examples=FAST, derandomize=True, **SETTINGS)
@given(generated=corpus_file, on_bad_record=st.sampled_from(["error", "skip"]))
# the slow run's find (2026-11-28): a field named "\n" broke the error's one line, in the advice
# to pass --text-column with it
@example(generated=([({"\n": ""}, None)], False, b"\n"), on_bad_record="error")
def test_generated_corpora_give_documents_skips_or_one_error(tmp_path, generated, on_bad_record):
    check_corpus_file(tmp_path, generated, on_bad_record)


@pytest.mark.slow
@settings(max_examples=THOROUGH, **SETTINGS)
@given(generated=corpus_file, on_bad_record=st.sampled_from(["error", "skip"]))
def test_generated_corpora_thoroughly(tmp_path, generated, on_bad_record):
    check_corpus_file(tmp_path, generated, on_bad_record)


def overlapping_range(start: int, end: int, teacher) -> tuple[int, int]:
    """By definition: the first and last teacher token that shares a character with the student
    span [start, end), or (-1, -1) where none does (a slow per-token oracle)."""
    t_start, t_end = teacher.start, teacher.end
    hits = np.flatnonzero((t_end > t_start) & (np.maximum(start, t_start) < np.minimum(end, t_end)))
    if end <= start or hits.size == 0:
        return -1, -1
    return int(hits.min()), int(hits.max())


def check_align_text(capsys, text: str) -> None:
    argv = ["align", "--student-tokenizer", "tinyllama", "--teacher-tokenizer", "qwen2.5"]
    code = vocagno([*argv, f"--text={text}"])  # the = form: a text may begin with "-"
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if any("\ud800" <= char <= "\udfff" for char in text):  # no UTF-8 spelling: refused
        assert code == 2 and err.count("\n") == 1 and "error:" in err and out == ""
        return
    assert code == 0 and out.count("\n") == 1, err
    record = json.loads(out)
    student, teacher = load_tokenizer("tinyllama"), load_tokenizer("qwen2.5")
    s_enc, t_enc = student.encode(text), teacher.encode(text)
    for side, enc in ((record["student"], s_enc), (record["teacher"], t_enc)):
        assert side["ids"] == enc.ids.tolist()  # each tokenizer's own framing, BOS per policy
        assert side["start"] == enc.start.tolist() and side["end"] == enc.end.tolist()
        assert all(
            0 <= a <= b <= len(text) for a, b in zip(side["start"], side["end"], strict=True)
        )
    expected = [overlapping_range(a, b, t_enc) for a, b in zip(s_enc.start, s_enc.end, strict=True)]
    assert list(zip(record["map_start"], record["map_end"], strict=True)) == expected


@settings(max_examples=FAST, derandomize=True, **SETTINGS)
@given(text=any_text)
def test_align_of_any_text_is_an_alignment_or_one_line(capsys, text):
    check_align_text(capsys, text)


@pytest.mark.slow
@settings(max_examples=THOROUGH, **SETTINGS)
@given(text=any_text)
def test_align_of_any_text_thoroughly(capsys, text):
    check_align_text(capsys, text)


@pytest.fixture(scope="module")
def pristine_manifest(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("cache")
    build_cache(cache, num_documents=4, docs_per_shard=2)
    return json.loads((cache / MANIFEST_NAME).read_text())


shard_field = st.sampled_from(["index", "file", "rows", "teacher_tokens", "bytes", "sha256"])
hostile_value = st.one_of(
    json_value,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(["../outside.parquet", "/etc/passwd", "shard-000000.parquet/..", "", "."]),
)


def check_hostile_manifest(tmp_path, manifest: dict, edits) -> None:
    data = json.loads(json.dumps(manifest))
    for shard_index, field, value in edits:
        data["shards"][shard_index % len(data["shards"])][field] = value
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / MANIFEST_NAME).write_text(json.dumps(data))
    try:
        loaded = load_manifest(cache)
    except CacheError:
        return
    for shard in loaded.shards:  # what was accepted is safe to use as a path and as counts
        assert (cache / shard.file).resolve().parent == cache.resolve()
        assert min(shard.rows, shard.teacher_tokens, shard.bytes) >= 0


edits = st.lists(st.tuples(st.integers(0, 9), shard_field, hostile_value), min_size=1, max_size=3)


@settings(max_examples=FAST, derandomize=True, **SETTINGS)
@given(edits=edits)
def test_hostile_manifests_are_refused_or_safe(tmp_path, pristine_manifest, edits):
    check_hostile_manifest(tmp_path, pristine_manifest, edits)


@pytest.mark.slow
@settings(max_examples=THOROUGH, **SETTINGS)
@given(edits=edits)
def test_hostile_manifests_thoroughly(tmp_path, pristine_manifest, edits):
    check_hostile_manifest(tmp_path, pristine_manifest, edits)
