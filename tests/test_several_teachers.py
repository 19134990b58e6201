"""Several teachers' caches of one corpus in one run (--more-caches, docs/several-teachers.md):
the combined teacher loss of every student token is each teacher's, aligned on its own and
combined by the rule, checked against a per-token oracle; caches of another corpus or layout are
refused in one line; a run with several caches trains, records them, and resumes exactly."""

from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipeline.cache.manifest import load_manifest
from pipeline.errors import CacheError, ConfigError
from pipeline.teacher_loss import combine_teacher_losses
from pipeline.tokenizer import load_tokenizer
from stage2_train.config import parse_train_config
from stage2_train.data.documents import DocumentReader
from stage2_train.data.more_teachers import teacher_caches, teacher_settings
from stage2_train.data.plan import DataPlan
from stage2_train.train import main
from tests.cache_fixtures import build_cache, corpus_documents, read_cache_rows
from tests.stage2_runs import read_metrics, train_args
from tests.test_stage2_data import overlap_oracle

DOCUMENTS = corpus_documents(16)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """Two teachers of the same 16 documents in shards of 8: qwen2.5's tokens with seeded
    losses, smollm2's with other seeded losses, and a copy of the first (one teacher twice)."""
    root = tmp_path_factory.mktemp("teachers")
    build_cache(root / "qwen", teacher_tokenizer="qwen2.5", documents=DOCUMENTS, seed=0)
    build_cache(root / "smollm2", teacher_tokenizer="smollm2", documents=DOCUMENTS, seed=1)
    shutil.copytree(root / "qwen", root / "qwen-copy")
    return {name: root / name for name in ("qwen", "smollm2", "qwen-copy")}


def plan_of(first: Path, *more: Path, combine: str = "min", alignment: str = "token") -> DataPlan:
    manifest = load_manifest(first)
    others = {path: load_manifest(path) for path in more}
    return DataPlan.from_cache(
        first,
        student_tokenizer="tinyllama",
        seq_len=64,
        micro_batch_size=2,
        more_caches=teacher_caches(first, manifest, others, lambda tokenizer: alignment),
        combine_teachers=combine,
    )


def streamed_losses(plan: DataPlan) -> dict[str, np.ndarray]:
    """Each document's per-student-token teacher loss, as one epoch of consumer 0 streams it."""
    found = {}
    for docs, _, epoch in DocumentReader(plan, 0).documents():
        if epoch > 0:
            break
        split = np.split(docs.teacher_loss, np.cumsum(docs.lengths)[:-1])
        found.update(zip(docs.doc_ids, split, strict=True))
    assert len(found) == len(DOCUMENTS)
    return found


def test_the_rules_take_the_teachers_that_map_a_token():
    a = np.array([1.0, np.nan, 3.0, np.nan], dtype=np.float32)
    b = np.array([2.0, 5.0, 0.5, np.nan], dtype=np.float32)
    np.testing.assert_array_equal(combine_teacher_losses([a, b], "min"), [1.0, 5.0, 0.5, np.nan])
    np.testing.assert_array_equal(combine_teacher_losses([a, b], "mean"), [1.5, 5.0, 1.75, np.nan])
    assert combine_teacher_losses([a], "mean") is a
    with pytest.raises(ValueError, match="rule must be one of"):
        combine_teacher_losses([a, b], "max")


@pytest.mark.parametrize("combine", ["min", "mean"])
def test_two_caches_of_one_teacher_combine_to_that_teacher(caches, combine):
    one = streamed_losses(plan_of(caches["qwen"]))
    two = streamed_losses(plan_of(caches["qwen"], caches["qwen-copy"], combine=combine))
    for doc_id, losses in one.items():
        np.testing.assert_array_equal(two[doc_id], losses)


@pytest.mark.parametrize("combine", ["min", "mean"])
def test_two_teachers_combine_per_token_as_an_independent_oracle_says(caches, combine):
    """Per student token, each teacher's aggregated loss by definition (a slow loop over the
    offsets, tests/test_stage2_data.py), then their minimum or mean over the teachers that
    give one."""
    streamed = streamed_losses(plan_of(caches["qwen"], caches["smollm2"], combine=combine))
    rows = [read_cache_rows(caches[name]) for name in ("qwen", "smollm2")]
    student = load_tokenizer("tinyllama")
    differ = 0
    for doc_id, text in DOCUMENTS:
        encoded = student.encode(text, add_eos=True)
        each = np.stack([overlap_oracle(encoded, r[doc_id], "max") for r in rows])
        with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):  # all-NaN columns
            expected = np.nanmin(each, 0) if combine == "min" else np.nanmean(each, 0)
        np.testing.assert_allclose(streamed[doc_id], expected, rtol=1e-6)
        differ += int((np.abs(each[0] - each[1]) > 1e-3).sum())
    assert differ > 100  # the teachers really disagree, so the rule decides


def test_a_cache_of_another_corpus_or_layout_is_refused_by_name(caches, tmp_path):
    build_cache(tmp_path / "fewer", documents=DOCUMENTS[:8], teacher_tokenizer="smollm2")
    with pytest.raises(CacheError, match=r"not a cache of --cache .* corpus documents is 8"):
        plan_of(caches["qwen"], tmp_path / "fewer")
    build_cache(tmp_path / "wide", documents=DOCUMENTS, docs_per_shard=16)
    with pytest.raises(CacheError, match=r"\(1 shards, not 2\): score the same --corpus"):
        plan_of(caches["qwen"], tmp_path / "wide")


def test_a_layout_or_targets_difference_is_named_not_shown_as_two_corpus_hashes(tmp_path):
    """Stage 1 records the hash of what reading the corpus gave, which --docs-per-shard and
    --targets change. Before: either difference was shown as two hashes of one file's content."""
    record = {"documents": 16, "content_sha256": "a" * 64}
    build_cache(tmp_path / "first", documents=DOCUMENTS, corpus=record)
    build_cache(tmp_path / "wide", documents=DOCUMENTS, docs_per_shard=16,
                corpus=record | {"content_sha256": "b" * 64})  # fmt: skip
    spans = {"mode": "spans", "column": "target_spans"}
    build_cache(tmp_path / "spans", documents=DOCUMENTS,
                corpus=record | {"content_sha256": "c" * 64, "targets": spans})  # fmt: skip
    for other, said in (("wide", "(1 shards, not 2)"),
                        ("spans", "(it read the corpus with --targets spans, --cache with "
                                  "--targets all)")):  # fmt: skip
        with pytest.raises(CacheError) as refused:
            plan_of(tmp_path / "first", tmp_path / other)
        assert said in str(refused.value) and "content_sha256" not in str(refused.value)


def test_other_documents_in_the_same_layout_are_refused_naming_the_row(caches, tmp_path):
    swapped = [DOCUMENTS[1], DOCUMENTS[0], *DOCUMENTS[2:]]
    build_cache(tmp_path / "swapped", documents=swapped, teacher_tokenizer="smollm2")
    plan = plan_of(caches["qwen"], tmp_path / "swapped")
    with pytest.raises(CacheError, match=r"shard-000000.parquet row 0 is document .* where the"):
        streamed_losses(plan)


def test_a_repeated_cache_is_refused(caches, tmp_path):
    with pytest.raises(ConfigError, match="names a cache twice"):
        parse_train_config(train_args(caches["qwen"], tmp_path, "--more-caches", str(caches["qwen"])))


def test_a_run_with_two_teachers_records_them_and_resumes_exactly(caches, tmp_path, capsys):
    """From a manifest, as a user writes one; stopped at step 3 and resumed, it reproduces the
    uninterrupted run's metrics exactly."""
    manifest = tmp_path / "two-teachers.toml"
    manifest.write_text(
        f'[stage2]\nmore_caches = ["{caches["smollm2"]}"]\ncombine_teachers = "mean"\n'
    )
    assert tomllib.loads(manifest.read_text())["stage2"]["more_caches"]
    common = ("--manifest", str(manifest), "--num-workers", "0", "--guidance", "token")
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    assert main(train_args(caches["qwen"], whole, *common)) == 0
    saved = json.loads((whole / "config.json").read_text())
    assert saved["more_caches"] == [str(caches["smollm2"])]
    assert saved["combine_teachers"] == "mean"
    assert main(train_args(caches["qwen"], parted, *common, "--stop-at-step", "3")) == 0
    assert main(train_args(caches["qwen"], parted, *common)) == 0
    assert read_metrics(parted) == read_metrics(whole)
    # another set of teachers is another run's data: its checkpoint is not continued, and the
    # refusal names the added cache (before: it blamed the unchanged --cache)
    assert main(train_args(caches["qwen"], tmp_path / "other", "--stop-at-step", "3")) == 0
    capsys.readouterr()
    assert main(train_args(caches["qwen"], tmp_path / "other", *common)) == 2
    err = capsys.readouterr().err
    assert "was trained with --more-caches (none), this run gives" in err
    assert "was trained on cache" not in err


@pytest.mark.slow  # starts moto's server; one cache in a bucket is in the default suite
def test_caches_in_a_bucket_stream_as_the_local_caches_do(caches, tmp_path):
    """Object storage works as with one cache: both caches read from a real S3-compatible
    server (verified local copies, tests/object_store.py) give the local run's losses."""
    pytest.importorskip("moto.server")
    from tests.object_store import moto_s3, upload_folder

    local = streamed_losses(plan_of(caches["qwen"], caches["smollm2"]))
    with moto_s3() as bucket:
        for name in ("qwen", "smollm2"):
            upload_folder(caches[name], f"{bucket}/{name}")
        first, other = f"{bucket}/qwen", f"{bucket}/smollm2"
        remote = streamed_losses(replace(plan_of(first, other), shard_cache=str(tmp_path)))
    assert remote.keys() == local.keys()
    for doc_id, losses in local.items():
        np.testing.assert_array_equal(remote[doc_id], losses)


# Two corpus files, as stage 1 names their documents without --id-column: <source>:<record>
SOURCES = {"sources": [{"name": "a.jsonl", "bytes": 10}, {"name": "b.jsonl", "bytes": 20}],
           "id_column": None}  # fmt: skip
SOURCED = [(f"{'ab'[i % 2]}.jsonl:{i // 2}", text) for i, (_, text) in enumerate(DOCUMENTS)]


@pytest.fixture(scope="module")
def sourced(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sourced")
    for name, seed in (("qwen", 0), ("smollm2", 1)):
        build_cache(root / name, teacher_tokenizer=name.replace("qwen", "qwen2.5"),
                    documents=SOURCED, seed=seed, corpus=SOURCES)  # fmt: skip
    return {name: root / name for name in ("qwen", "smollm2")}


def test_a_named_teacher_per_source_gives_each_document_its_teachers_loss(sourced, tmp_path):
    """--combine-teachers source: a.jsonl's documents get the first teacher's loss, b.jsonl's
    the second's, each equal to the slow per-token oracle of that teacher alone; a run with it
    trains (data-loader workers included) and saves the choice."""
    plan = replace(plan_of(sourced["qwen"], sourced["smollm2"], combine="source"),
                   source_teachers={"a.jsonl": 0, "b.jsonl": 1})  # fmt: skip
    streamed = streamed_losses(plan)
    rows = {name: read_cache_rows(sourced[name]) for name in ("qwen", "smollm2")}
    student = load_tokenizer("tinyllama")
    for doc_id, text in SOURCED:
        teacher = "qwen" if doc_id.startswith("a.jsonl:") else "smollm2"
        expected = overlap_oracle(student.encode(text, add_eos=True), rows[teacher][doc_id], "max")
        np.testing.assert_allclose(streamed[doc_id], expected, rtol=1e-6)
    first, other = str(sourced["qwen"]), str(sourced["smollm2"])
    chosen = [f"a.jsonl={first}", f"b.jsonl={other}"]
    run = ("--more-caches", other, "--combine-teachers", "source", "--source-teachers", *chosen)
    assert main(train_args(sourced["qwen"], tmp_path / "run", *run)) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["source_teachers"] == chosen


def test_source_teachers_are_refused_unless_they_name_every_source(sourced, tmp_path):
    first, other = str(sourced["qwen"]), str(sourced["smollm2"])
    base = train_args(sourced["qwen"], tmp_path, "--more-caches", other)
    with pytest.raises(ConfigError, match="go together"):
        parse_train_config([*base, "--combine-teachers", "source"])
    with pytest.raises(ConfigError, match="need SOURCE=CACHE, CACHE one of --cache"):
        parse_train_config([*base, "--combine-teachers", "source", "--source-teachers", "a.jsonl"])
    with pytest.raises(ConfigError, match="two teachers for 'a.jsonl'"):
        parse_train_config([*base, "--combine-teachers", "source", "--source-teachers",
                            f"a.jsonl={first}", f"a.jsonl={other}"])  # fmt: skip
    only_a = [*base, "--combine-teachers", "source", "--source-teachers", f"a.jsonl={first}"]
    assert main(only_a) == 2
    with pytest.raises(ConfigError, match="each of the corpus's sources, a.jsonl, b.jsonl"):
        run_settings(parse_train_config(only_a))
    ids = [tmp_path / "ids-a", tmp_path / "ids-b"]  # ids from a column do not name their source
    for path in ids:
        build_cache(path, documents=SOURCED, corpus={**SOURCES, "id_column": "id"})
    config = parse_train_config([*train_args(ids[0], tmp_path, "--more-caches", str(ids[1])),
                                 "--combine-teachers", "source", "--source-teachers",
                                 f"a.jsonl={ids[0]}", f"b.jsonl={ids[1]}"])  # fmt: skip
    with pytest.raises(ConfigError, match="ids come from its 'id' column: use min or mean"):
        run_settings(config)


def run_settings(config) -> dict:
    more = {location: load_manifest(location) for location in config.data.more_caches}
    return teacher_settings(config.data, config.guidance, load_manifest(config.data.cache), more,
                            lambda tokenizer: "token")  # fmt: skip
