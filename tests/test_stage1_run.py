"""Stage 1 end to end through a real local Ray cluster: the cache matches the teacher, a rerun is
byte-identical and resumes only what is missing, other settings refuse to mix, bad input is named.

One Ray instance (2 CPUs) serves the module; runs go through `stage1_score.run.main`, which joins
it. Failures that happen before any worker starts are tested without Ray.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from importlib.machinery import ModuleSpec
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zstandard

from pipeline.cache import topk_codec
from pipeline.cache.manifest import SkippedDocument, load_manifest, profile_name
from pipeline.cache.rows import token_values
from pipeline.cache.verify import verify_cache
from pipeline.config import parse_config
from pipeline.corpus import Corpus, CorpusOptions
from pipeline.io import sha256_text
from pipeline.scoring.teacher import TeacherError
from pipeline.tokenizer import load_tokenizer
from pipeline.versions import software_versions
from stage1_score.output import LOCK_NAME, OutputLock
from stage1_score.run import main
from tests.cache_fixtures import read_cache_rows
from tests.stage1_helpers import (
    load_model,
    make_tiny_teacher,
    shipped_documents,
    windowed_direct_logprobs,
    windowed_direct_losses,
    write_jsonl_corpus,
)

REPO = Path(__file__).resolve().parents[1]
NUM_DOCS, DOCS_PER_SHARD, MAX_LENGTH, STRIDE = 24, 6, 64, 24


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", "tinyllama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """NUM_DOCS real documents, plus an empty one (record 3) and a repeated id (the last record)."""
    documents = shipped_documents(NUM_DOCS)
    documents.insert(3, ("empty", " \n\t"))
    documents.append(documents[0])
    return write_jsonl_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl", documents)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def args(teacher, corpus, out, *extra) -> list[str]:
    return [
        "--teacher", str(teacher), "--corpus", str(corpus), "--out", str(out),
        "--id-column", "id", "--docs-per-shard", str(DOCS_PER_SHARD),
        "--max-length", str(MAX_LENGTH), "--stride", str(STRIDE), "--batch-tokens", "512",
        "--on-bad-record", "skip", *extra,
    ]  # fmt: skip


def one_line_error(capsys) -> str:
    """The run's error: one line, last on stderr, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("stage1: error: ")
    return last


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of the cache that a rerun must reproduce (not the lock, not the run record)."""
    skip = {LOCK_NAME, "stage1-run.json"}
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in skip}


@pytest.fixture(scope="module")
def built(ray_cluster, teacher, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "cache"
    command = args(teacher, corpus, out, "--num-workers", "2", "--loss-dtype", "float32")
    assert main(command) == 0
    return out, command, snapshot(out)


def test_two_workers_build_a_verified_cache_equal_to_the_teacher(built, teacher, corpus):
    out, _, _ = built
    manifest, problems = verify_cache(out)
    assert problems == []
    assert [s.index for s in manifest.shards] == list(range(-(-NUM_DOCS // DOCS_PER_SHARD)))
    assert manifest.total_rows == NUM_DOCS
    assert manifest.software == software_versions()  # Triton's among them: test_versions.py
    first_id = json.loads(corpus.read_text().splitlines()[0])["id"]
    assert [(s.record, s.doc_id, s.reason) for s in manifest.skipped] == [
        (3, "empty", "empty or whitespace-only text"),
        (
            NUM_DOCS + 1,
            first_id,
            f"duplicate document id {first_id!r} (first at docs.jsonl record 0)",
        ),
    ]
    assert manifest.corpus["documents"] + manifest.corpus["skipped"] == NUM_DOCS + 2
    assert manifest.settings.to_json() == {
        "max_length": MAX_LENGTH, "stride": STRIDE, "loss_dtype": "float32",
        "docs_per_shard": DOCS_PER_SHARD,
    }  # fmt: skip
    assert manifest.teacher["backend"] == "hf" and len(manifest.teacher["content_sha256"]) == 64
    tokenizer = load_tokenizer(str(teacher))
    assert manifest.tokenizer["fingerprint"] == tokenizer.fingerprint
    rows = [r for s in manifest.shards for r in pq.read_table(out / s.file).to_pylist()]
    source = {
        d.doc_id: d.text
        for d in Corpus(corpus, CorpusOptions(id_column="id", on_bad_record="skip"))
        if not isinstance(d, SkippedDocument)
    }
    assert [r["doc_id"] for r in rows] == list(source)  # corpus order, unit k -> shard k
    model = load_model(teacher)
    windowed = 0
    for row in rows:
        assert row["text"] == source[row["doc_id"]]
        assert row["text_sha256"] == sha256_text(row["text"])
        encoding = tokenizer.encode(row["text"])
        assert row["token_ids"] == encoding.ids.tolist()
        assert row["token_start"] == encoding.start.tolist()
        assert row["token_end"] == encoding.end.tolist()
        loss = np.array(row["loss"], dtype=np.float32)
        expected = windowed_direct_losses(model, encoding.ids, MAX_LENGTH, STRIDE)
        np.testing.assert_allclose(loss, expected, atol=1e-4, rtol=0)
        assert row["token_ids"][0] == tokenizer.bos_id
        assert np.isnan(loss[0]) and np.isfinite(loss[1:]).all()
        windowed += len(encoding) > MAX_LENGTH
    assert windowed > NUM_DOCS // 2


def test_topk_probs_8_and_space_logprob_are_cached_by_the_fused_head_and_equal_the_teacher(
    ray_cluster, teacher, corpus, tmp_path
):
    from pipeline.cache.stats import cache_stats
    from pipeline.space_mask import space_mask

    out = tmp_path / "cache"
    # the head's GPU switches (auto's choices there), through the job to its workers
    switches = ("--head-kernel", "fused", "--head-chunks", "sized", "--batch-overlap", "on")
    assert main(args(teacher, corpus, out, "--topk-probs", "8", "--space-logprob", *switches)) == 0
    manifest, problems = verify_cache(out)
    assert problems == []
    backend = json.loads((out / "stage1-run.json").read_text())["backend"]
    assert (backend["head_kernel"], backend["head_chunks"], backend["batch_overlap"]) == (
        "fused", "sized", "on"
    )  # fmt: skip
    assert backend["compile"] == "off"  # auto on a CPU
    tokenizer = load_tokenizer(str(teacher))
    mask, identity = space_mask(tokenizer, tokenizer.vocab_size)
    assert manifest.settings.topk_probs == 8 and manifest.settings.topk_id_dtype == "uint16"
    assert manifest.settings.space_logprob == identity
    assert manifest.settings.topk_encoding == "compact"  # the default
    per_column = cache_stats(out).column_bytes_per_token
    assert {"topk_codes", "topk_id_ranks", "topk_rest", "space_logprob"} <= set(per_column)
    model = load_model(teacher)
    stored = topk_codec.RELATIVE_ERROR + 2e-3  # the compact codes, and the fused head's rounding
    for shard in manifest.shards:
        batch = pq.read_table(out / shard.file).combine_chunks().to_batches()[0]
        cuts = np.cumsum(batch.column("token_ids").value_lengths().to_numpy())[:-1]
        topk = [np.split(token_values(batch, name), cuts) for name in ("topk_probs", "topk_ids")]
        for row, probs, top in zip(batch.to_pylist(), *topk, strict=True):
            ids = np.array(row["token_ids"])
            reference = windowed_direct_logprobs(model, ids, MAX_LENGTH, STRIDE)[1:]
            assert np.isnan(probs[0]).all() and (top[0] == -1).all()  # token 0: a null entry
            assert np.isnan(row["topk_rest"][0]) and np.isnan(row["space_logprob"][0])
            probs, top = probs[1:], top[1:]
            expected = -np.sort(-np.exp(reference), axis=1)[:, :8]
            np.testing.assert_allclose(probs, expected, rtol=stored, atol=1e-6)
            picked = np.exp(np.take_along_axis(reference, top, axis=1))  # ties may reorder ids
            np.testing.assert_allclose(picked, probs, rtol=stored, atol=1e-6)
            space = np.logaddexp.reduce(reference[:, mask], axis=1)
            np.testing.assert_allclose(row["space_logprob"][1:], space, atol=2e-3, rtol=0)
            rest = np.array(row["topk_rest"][1:], dtype=np.float32)
            np.testing.assert_allclose(rest, 1 - expected.sum(1), atol=2e-3)


def test_a_sampled_cache_is_verified_and_a_rerun_draws_the_same_bytes(
    ray_cluster, teacher, corpus, tmp_path
):
    """`--topk-mode sampled` through the job and its workers: the manifest names the mode and
    the seed, `cache verify` passes, and a second run into another folder with other batches
    draws the same ids, of the same ranks (their log-probabilities round with the batch). Four
    documents in two shards: drawing over the tinyllama head is slow on a CPU (24 took 44 s;
    tests/test_sampled_cache.py holds more draws to the batching)."""
    corpus = write_jsonl_corpus(tmp_path / "few.jsonl", shipped_documents(4))
    outs = [tmp_path / "first", tmp_path / "second"]
    drawn = ("--topk-probs", "8", "--topk-mode", "sampled", "--sample-seed", "5",
             "--docs-per-shard", "2")  # fmt: skip
    assert main(args(teacher, corpus, outs[0], *drawn)) == 0
    assert main([*args(teacher, corpus, outs[1], *drawn), "--batch-tokens", "256"]) == 0
    manifest, problems = verify_cache(outs[0])
    assert problems == [] and manifest.settings.topk_mode == "sampled"
    assert manifest.settings.sample_seed == 5 and "topk_encoding" not in manifest.settings.to_json()
    for shard in manifest.shards:
        first, second = (pq.read_table(out / shard.file) for out in outs)
        assert "sample_ids" in first.column_names and "topk_rest" not in first.column_names
        for name in ("sample_ids", "sample_ranks"):
            assert first.column(name).equals(second.column(name))


def test_chat_records_are_scored_whole_and_cached_with_their_assistant_spans(
    ray_cluster, teacher, tmp_path, capsys
):
    """`--targets chat`: each record's messages rendered by the template are the row's text
    (the teacher scores all of it), the assistant turns its target_spans; the manifest's corpus
    names the rendering, and another template is another corpus."""
    from pipeline.corpus.targets import TEMPLATES, render_chat
    from pipeline.shipped import shipped_corpus

    records = [
        json.loads(line)
        for line in zstandard.decompress(shipped_corpus("chat-train").read_bytes())
        .decode()
        .splitlines()[:12]
    ]
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "cache"
    assert main(args(teacher, corpus, out, "--targets", "chat")) == 0
    manifest, problems = verify_cache(out)
    assert problems == [] and manifest.settings.target_spans is True
    assert manifest.corpus["targets"]["template"] == {"name": "chatml", **TEMPLATES["chatml"].describe()}
    rows = read_cache_rows(out)
    for record in records:
        text, spans = render_chat(record["messages"], TEMPLATES["chatml"])
        row = rows[record["id"]]
        assert row["text"] == text and row["target_spans"] == [b for s in spans for b in s]
        assert not np.isnan(np.asarray(row["loss"][1:], dtype=float)).any()  # all of it scored
    assert main(args(teacher, corpus, out, "--targets", "chat", "--chat-template", "plain")) == 2
    assert "--overwrite" in one_line_error(capsys)


@pytest.fixture(scope="module")
def chat_teacher(tmp_path_factory) -> Path:
    """A tiny teacher whose tokenizer (SmolLM2's) carries SmolLM2-Instruct's chat template."""
    from pipeline.shipped import shipped_chat_template

    smol = make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "smol", "smollm2")
    config = json.loads((smol / "tokenizer_config.json").read_text())
    config["chat_template"] = shipped_chat_template("smollm2-instruct.jinja").read_text()
    (smol / "tokenizer_config.json").write_text(json.dumps(config))
    return smol


def chat_corpus(folder: Path, count: int) -> tuple[Path, list[dict]]:
    from pipeline.shipped import shipped_corpus

    lines = zstandard.decompress(shipped_corpus("chat-train").read_bytes()).decode().splitlines()
    records = [json.loads(line) for line in lines[:count]]
    corpus = folder / "chat.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    return corpus, records


def test_the_teacher_s_own_template_renders_the_plan_s_documents(
    chat_teacher, teacher, tmp_path, capsys
):
    """`--chat-template teacher`, planned without Ray: each document's text is the teacher
    tokenizer's chat_template rendered by apply_chat_template, its spans the assistant turns, and
    the cache's identity names the template; a teacher whose tokenizer has none is one line."""
    from transformers import PreTrainedTokenizerFast

    from stage1_score import job
    from stage1_score.config import ScoreConfig

    corpus, records = chat_corpus(tmp_path, 3)
    chat = ("--targets", "chat", "--chat-template", "teacher")
    planned = job.plan(
        parse_config(ScoreConfig, args(chat_teacher, corpus, tmp_path / "o", *chat), "", "stage1")
    )
    hf = PreTrainedTokenizerFast.from_pretrained(chat_teacher)
    for record, document in zip(records, planned.corpus, strict=True):
        assert document.text == hf.apply_chat_template(record["messages"], tokenize=False)
        ((start, end),) = document.target_spans
        assert document.text[start:end] == record["messages"][-1]["content"] + "<|im_end|>"
    template = planned.identity["corpus"]["targets"]["template"]
    assert template["name"] == "teacher" and len(template["chat_template_sha256"]) == 64
    assert main(args(teacher, corpus, tmp_path / "other", *chat)) == 2
    assert "has no chat_template" in one_line_error(capsys)


def test_the_student_s_own_template_renders_the_text_the_teacher_scores(teacher, tmp_path, capsys):
    """`--chat-template student --student-tokenizer qwen2.5`: the records are rendered in the
    student's template (Qwen2.5-Instruct's, which the shipped qwen2.5 tokenizer carries) and the
    teacher (TinyLlama's vocabulary, no template) scores that text; the option is refused where
    it would be missing or unread."""
    from pipeline.corpus.own_template import own_template
    from stage1_score import job
    from stage1_score.config import ScoreConfig

    corpus, records = chat_corpus(tmp_path, 2)
    chat = ("--targets", "chat", "--chat-template", "student")
    argv = args(teacher, corpus, tmp_path / "o", *chat, "--student-tokenizer", "qwen2.5")
    planned = job.plan(parse_config(ScoreConfig, argv, "", "stage1"))
    qwen = own_template("student", load_tokenizer("qwen2.5"))
    for record, document in zip(records, planned.corpus, strict=True):
        text = qwen.tokenizer.apply_chat_template(record["messages"], tokenize=False)
        assert document.text == text and text.startswith("<|im_start|>system\nYou are Qwen")
    assert planned.identity["corpus"]["targets"]["template"] == qwen.describe()
    assert main(args(teacher, corpus, tmp_path / "p", *chat)) == 2
    assert "student needs --student-tokenizer" in one_line_error(capsys)
    assert main(args(teacher, corpus, tmp_path / "q", "--student-tokenizer", "qwen2.5")) == 2
    assert "read only by --chat-template student" in one_line_error(capsys)


@pytest.mark.slow
def test_chat_records_in_the_teacher_s_own_template_end_to_end(ray_cluster, chat_teacher, tmp_path):
    """The cache of such a run holds the rendered text and the spans, and verifies."""
    corpus, records = chat_corpus(tmp_path, 4)
    out = tmp_path / "cache"
    assert (
        main(args(chat_teacher, corpus, out, "--targets", "chat", "--chat-template", "teacher"))
        == 0
    )
    manifest, problems = verify_cache(out)
    assert problems == [] and manifest.corpus["targets"]["template"]["name"] == "teacher"
    rows = read_cache_rows(out)
    for record in records:
        row = rows[record["id"]]
        start, end = row["target_spans"]
        assert row["text"][start:end] == record["messages"][-1]["content"] + "<|im_end|>"
        assert row["text"].startswith(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
        )
        assert not np.isnan(np.asarray(row["loss"][1:], dtype=float)).any()


def test_dtype_auto_is_bfloat16_where_the_workers_get_gpus(teacher, corpus, tmp_path, monkeypatch):
    """What the driver resolves --dtype auto to, from the GPUs of the cluster it will join
    (stage 2's --dtype auto computes alike), into the cache's identity; any other choice stands."""
    from stage1_score import job
    from stage1_score.config import ScoreConfig

    def planned(gpus: int, *extra: str) -> job.Plan:
        monkeypatch.setattr(job, "cluster_gpus", lambda address: gpus)
        argv = args(teacher, corpus, tmp_path / "o", *extra)
        return job.plan(parse_config(ScoreConfig, argv, "", "stage1"))

    on_gpus = planned(2)
    assert on_gpus.dtype == on_gpus.identity["teacher"]["dtype"] == "bfloat16"
    assert planned(0).identity["teacher"]["dtype"] == "float32"
    assert planned(2, "--dtype", "float32").dtype == "float32"
    assert planned(2, "--dtype", "checkpoint").dtype == "checkpoint"


def test_max_docs_caches_the_first_records_and_refuses_to_mix_with_another_slice(
    ray_cluster, teacher, corpus, tmp_path, capsys
):
    out = tmp_path / "cache"
    assert main(args(teacher, corpus, out, "--max-docs", "7")) == 0
    manifest = load_manifest(out)
    assert manifest.corpus["max_docs"] == 7
    assert manifest.total_rows + len(manifest.skipped) == 7  # record 3 is skipped as empty
    whole = Corpus(corpus, CorpusOptions(id_column="id", on_bad_record="skip"))
    first = [doc.doc_id for doc in itertools.islice(whole, 7) if not isinstance(doc, SkippedDocument)]
    assert list(read_cache_rows(out)) == first
    capsys.readouterr()
    assert main(args(teacher, corpus, out, "--max-docs", "8")) == 2
    assert "max_docs" in one_line_error(capsys)


def test_rerun_is_byte_identical_and_recomputes_only_a_missing_shard(built):
    out, command, first = built
    assert main(command) == 0
    assert snapshot(out) == first
    # --dtype auto (the default) is float32 on CPU workers, in the identity: a cache made with
    # the former default, --dtype float32, is the same cache
    assert json.loads((out / "manifest.json").read_text())["teacher"]["dtype"] == "float32"
    assert main([*command, "--dtype", "float32"]) == 0
    assert snapshot(out) == first
    untouched = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    (out / "shard-000002.parquet").unlink()
    assert main(command) == 0
    assert snapshot(out) == first
    changed = {
        p.name for p in out.glob("shard-*.parquet") if p.stat().st_mtime_ns != untouched[p.name]
    }
    assert changed == {"shard-000002.parquet"}


def test_the_manifest_names_the_software_of_the_workers_that_scored_each_shard(
    built, tmp_path, monkeypatch, capsys
):
    """The manifest's software record is the scoring workers', never the driver's (which stores
    nothing it computed); a cache resumed under other software (its identity names the backend's
    version, not torch's) says which shards each version scored, in the manifest and in a line."""
    built_out, command, _ = built
    out = tmp_path / "cache"
    shutil.copytree(built_out, out)
    command = [str(out) if arg == str(built_out) else arg for arg in command]
    workers = software_versions()  # the workers' environment: this process's
    assert json.loads((out / "shard-000000.json").read_text())["software"] == workers
    sidecar = json.loads((out / "shard-000001.json").read_text())
    sidecar["software"]["torch"] = "2.0.0+elsewhere"  # unit 1 scored under another torch
    (out / "shard-000001.json").write_text(json.dumps(sidecar))
    (out / "shard-000002.parquet").unlink()  # unit 2 scored again by this run's worker
    # A package the driver alone has in another build (a worker process imports its own); with a
    # spec, as an imported module has, for libraries that look for the package while it is there.
    stand_in = type(sys)("gguf")
    stand_in.__version__, stand_in.__spec__ = "0.0.0+driver", ModuleSpec("gguf", None)
    monkeypatch.setitem(sys.modules, "gguf", stand_in)
    assert main(command) == 0
    software = load_manifest(out).software
    assert software.pop("torch") == {workers["torch"]: [0, 2, 3], "2.0.0+elsewhere": [1]}
    assert software == {p: v for p, v in workers.items() if p != "torch"}
    assert json.loads((out / "shard-000002.json").read_text())["software"] == workers
    assert (
        f"shards were scored with different software: torch {workers['torch']} (3 shards), "
        "2.0.0+elsewhere (1 shard); manifest.json names each value's shards (software)"
    ) in capsys.readouterr().err


def test_each_shard_records_the_switches_its_worker_resolved(built, tmp_path, capsys):
    """Each unit's sidecar carries the hf backend's switches as its worker resolved them (on a CPU
    every auto is the plain path), the manifest gathers them as it gathers the software, and a
    cache resumed under other switches (planted: unit 1 as a GPU worker's onepass head scored
    it) says which shards each value scored, in the manifest and in one line."""
    built_out, command, _ = built
    out = tmp_path / "cache"
    shutil.copytree(built_out, out)
    command = [str(out) if arg == str(built_out) else arg for arg in command]
    on_a_cpu = {
        "head_kernel": "plain", "head_chunks": "fixed", "row_packing": "padded",
        "attention": None, "batch_overlap": "off", "compile": "off",
    }  # fmt: skip
    assert json.loads((out / "shard-000000.json").read_text())["switches"] == on_a_cpu
    assert load_manifest(out).switches == on_a_cpu
    sidecar = json.loads((out / "shard-000001.json").read_text())
    sidecar["switches"]["head_kernel"] = "onepass"
    (out / "shard-000001.json").write_text(json.dumps(sidecar))
    (out / "shard-000002.parquet").unlink()  # unit 2 scored again by this run's worker
    assert main(command) == 0
    switches = load_manifest(out).switches
    assert switches.pop("head_kernel") == {"plain": [0, 2, 3], "onepass": [1]}
    assert switches == {name: v for name, v in on_a_cpu.items() if name != "head_kernel"}
    assert (
        "shards were scored with different switches: head_kernel plain (3 shards), onepass "
        "(1 shard); manifest.json names each value's shards (switches)"
    ) in capsys.readouterr().err


def overlaps(a: list[float], b: list[float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_overlapped_units_cache_the_same_bytes_with_writing_beside_scoring(built, tmp_path):
    """--unit-overlap on (auto's choice with GPU workers): one worker holds two units at once,
    one on the teacher while the other is tokenized or written, and the cache is byte for byte
    the one built one unit after another (auto on CPUs: no two units of a worker overlap). The
    run record's account of each unit's device time fits within the unit's scoring."""
    built_out, command, first = built
    serial = json.loads((built_out / "stage1-run.json").read_text())
    assert serial["unit_overlap"] == "off"
    for worker in {u["worker"] for u in serial["units"].values()}:
        spans = [
            [u["phases"]["tokenize"][0], u["phases"]["write"][1]]
            for u in serial["units"].values()
            if u["worker"] == worker
        ]
        assert not any(overlaps(a, b) for a, b in itertools.combinations(spans, 2)), spans
    out = tmp_path / "overlapped"
    overlapped = [str(out) if arg == str(built_out) else arg for arg in command]
    assert main([*overlapped, "--num-workers", "1", "--unit-overlap", "on"]) == 0
    assert snapshot(out) == first
    record = json.loads((out / "stage1-run.json").read_text())
    assert record["unit_overlap"] == "on" and record["workers"] == 1
    phases = [u["phases"] for u in record["units"].values()]
    scoring = [p["score"] for p in phases]
    assert not any(overlaps(a, b) for a, b in itertools.combinations(scoring, 2))  # one at a time
    # Each unit's device time (on a CPU the host's clock, as the phases are) lies within its
    # scoring, from its first batch to its last one's read-back, and with the units' edges adds up
    # to no more than the worker's scoring; the worker's first unit has no edge.
    units = sorted(record["units"].values(), key=lambda u: u["phases"]["score"][0])
    edges = [u["device"]["before_first_s"] for u in units]
    assert edges[0] is None and all(edge >= 0 for edge in edges[1:]), edges
    for unit in units:
        device, score, collect = unit["device"], unit["phases"]["score"], unit["phases"]["collect"]
        assert device["batches"] >= 1 and device["in_batches_s"] > 0, device
        assert device["in_batches_s"] + device["between_batches_s"] <= collect[1] - score[0] + 2e-3
    account = sum(u["device"]["in_batches_s"] + u["device"]["between_batches_s"] for u in units)
    span = units[-1]["phases"]["collect"][1] - units[0]["phases"]["score"][0]
    assert account + sum(edges[1:]) <= span + 2e-3
    beside = [
        (i, j)
        for i, p in enumerate(phases)
        for j, q in enumerate(phases)
        if i != j and (overlaps(p["write"], q["score"]) or overlaps(p["tokenize"], q["score"]))
    ]
    assert beside, phases


def loaded_worker(teacher: Path, out: Path):
    """An in-process worker of the tiny teacher (--batch-overlap on, a GPU's default), loaded."""
    import torch

    from pipeline.cache.settings import CacheSettings
    from pipeline.config import from_flat
    from pipeline.scoring.resolve import Asked, resolve
    from pipeline.scoring.teacher import resolve_teacher
    from stage1_score.config import ScoreConfig
    from stage1_score.worker import UnitScorer, WorkerSpec

    config = from_flat(ScoreConfig, {
        "teacher": str(teacher), "corpus": str(out), "out": str(out), "dtype": "float32",
        "batch_tokens": 128, "loss_dtype": "float32", "progress_seconds": 1e9,
        "batch_overlap": "on",
    })  # fmt: skip
    spec = WorkerSpec(
        config, resolve(Asked.of(config), torch.device("cpu")), resolve_teacher(str(teacher)),
        CacheSettings(max_length=MAX_LENGTH, stride=STRIDE, loss_dtype="float32"), out,
        run_fingerprint="test", threads=1,
    )  # fmt: skip
    worker = UnitScorer(spec)
    worker.describe()  # loads the teacher
    return worker


def shipped_unit(index: int, docs: int = 8):
    """Work unit `index` of `docs` shipped documents, the next ones after unit `index - 1`'s."""
    from stage1_score.units import WorkUnit

    texts = [text for _, text in shipped_documents(docs * (index + 1))[docs * index :]]
    doc_ids = [f"d{index}-{i}" for i in range(docs)]
    return WorkUnit(index, doc_ids, texts, [sha256_text(t) for t in texts], [], "content", 1.0)


def test_a_unit_holds_the_teacher_only_while_its_batches_are_queued(teacher, tmp_path):
    """--batch-overlap on (a GPU's default) under --unit-overlap: a unit holds the teacher (the
    worker's lock) while its batches are queued, and reads its last batch back after releasing
    it, so that the next unit queues its first batch behind that one and the device does not
    wait at the units' edge for a read-back and the next unit's first inputs. The unit's batches
    are planned before it holds the teacher, and the plan made is the one queued."""
    worker = loaded_worker(teacher, tmp_path)
    held, queue_columns, plan = {}, worker._scorer.queue_columns, worker._scorer.plan
    planned = []

    def plan_and_watch(ids):
        held["planning"] = worker._device.locked()
        planned.append(plan(ids))
        return planned[-1]

    def queue_and_watch(ids, progress, plan):
        held["queueing"] = worker._device.locked()
        held["queued the plan made"] = plan is planned[-1]
        queued = queue_columns(ids, progress, plan)
        collect = queued.collect

        def collect_and_watch():
            held["in flight"] = len(queued.in_flight)
            held["collecting"] = worker._device.locked()
            return collect()

        queued.collect = collect_and_watch
        return queued

    worker._scorer.queue_columns = queue_and_watch
    worker._scorer.plan = plan_and_watch
    phases = worker.score_unit(shipped_unit(0)).phases
    assert held == {
        "planning": False, "queueing": True, "queued the plan made": True, "in flight": 1,
        "collecting": False,
    }  # fmt: skip
    order = [phases[name] for name in ("tokenize", "score", "collect", "write")]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(order)), phases


def test_a_worker_tokenizes_its_units_in_turn(teacher, tmp_path):
    """Under --unit-overlap a worker's first two units arrive together. The tokenizer spreads one
    call over every core, so two at once share them, and the teacher waits for the first unit
    until both are done (benchmarks/bench_stage1_tokenizing.py: 1.9 times its own time on 2
    cores). The second unit's tokenizing begins after the first's ends, even when it arrives
    while the first is being tokenized, and each unit is scored as if alone."""
    worker = loaded_worker(teacher, tmp_path)
    encode, spans = worker._tokenizer.encode_batch, {}
    first_inside, second_arrived = threading.Event(), threading.Event()
    in_turn = worker._tokenizing

    class WatchedTurn:  # the second unit's arrival at its turn to tokenize, before it waits
        def __enter__(self):
            if first_inside.is_set():
                second_arrived.set()
            return in_turn.__enter__()

        def __exit__(self, *exc):
            return in_turn.__exit__(*exc)

    def encode_and_watch(texts):
        start = time.monotonic()
        if not first_inside.is_set():  # the first unit: held until the second has come
            first_inside.set()
            assert second_arrived.wait(60)
        else:  # the second unit tokenizing: if the first is still held, it did not wait its turn
            second_arrived.set()
        encodings = encode(texts)
        spans[texts[0]] = [start, time.monotonic()]
        return encodings

    worker._tokenizer.encode_batch = encode_and_watch
    worker._tokenizing = WatchedTurn()
    units, results = [shipped_unit(0), shipped_unit(1)], {}

    def score(unit):
        results[unit.index] = worker.score_unit(unit)

    first = threading.Thread(target=score, args=(units[0],))
    first.start()
    assert first_inside.wait(60)
    score(units[1])
    first.join(60)
    first_span, second_span = (spans[unit.texts[0]] for unit in units)
    assert first_span[1] <= second_span[0], spans
    alone = loaded_worker(teacher, tmp_path / "alone")
    for unit in units:
        assert results[unit.index].shard == alone.score_unit(unit).shard


def test_packed_rows_cache_what_padded_rows_do_and_are_recorded(built, tmp_path):
    """--row-packing packed (auto's choice on a GPU), through the job to its workers: every column
    but the loss byte for byte the padded cache's, the loss within fp32 rounding, and the resolved
    layout in stage1-run.json (auto on a CPU: padded)."""
    built_out, command, _ = built
    padded = json.loads((built_out / "stage1-run.json").read_text())["backend"]
    assert (padded["row_packing"], padded["attention"]) == ("padded", None)
    out = tmp_path / "packed"
    packed_command = [str(out) if arg == str(built_out) else arg for arg in command]
    assert main([*packed_command, "--row-packing", "packed", "--attention", "dense"]) == 0
    backend = json.loads((out / "stage1-run.json").read_text())["backend"]
    assert (backend["row_packing"], backend["attention"]) == ("packed", "dense")
    manifest, problems = verify_cache(out)
    assert problems == []
    for shard in manifest.shards:
        ours = pq.read_table(out / shard.file)
        theirs = pq.read_table(built_out / shard.file)
        assert ours.drop(["loss"]).equals(theirs.drop(["loss"]))
        for a, b in zip(ours["loss"].to_pylist(), theirs["loss"].to_pylist(), strict=True):
            np.testing.assert_allclose(np.array(a, np.float32), np.array(b, np.float32), rtol=1e-5)


def test_other_settings_refuse_to_mix_until_overwrite(built, tmp_path, capsys):
    source, command, _ = built
    out = tmp_path / "cache"
    shutil.copytree(source, out)
    changed = [*args(*command[1:6:2], "--stride", "16"), "--num-workers", "1"]
    changed[changed.index("--out") + 1] = str(out)
    capsys.readouterr()
    assert main(changed) == 2
    error = capsys.readouterr().err
    assert "holds a cache made differently" in error and "settings.stride: 24 -> 16" in error
    assert "settings.loss_dtype" in error  # float32 there, the default float16 here
    assert load_manifest(out).settings.stride == STRIDE  # untouched
    assert main([*changed, "--overwrite"]) == 0
    manifest, problems = verify_cache(out)
    assert problems == [] and manifest.settings.stride == 16
    assert manifest.settings.loss_dtype == "float16"
    assert pq.read_schema(out / "shard-000000.parquet").field("loss").type.value_type == "halffloat"


def test_a_corpus_changed_in_place_is_refused(built, corpus, tmp_path, capsys):
    """Same file name and size, other text: the unit content hash catches it on resume."""
    source, command, _ = built
    out, changed_corpus = tmp_path / "cache", tmp_path / corpus.name
    shutil.copytree(source, out)
    text = corpus.read_text()
    changed_corpus.write_text(text.replace("Question", "Questiom", 1))
    assert len(changed_corpus.read_bytes()) == len(corpus.read_bytes())
    changed = [str(changed_corpus) if a == str(corpus) else a for a in command]
    changed[changed.index("--out") + 1] = str(out)
    assert main(changed) == 2
    error = one_line_error(capsys)
    assert "unit 0 in" in error and "the corpus changed" in error


def test_bad_record_stops_the_run_and_the_rerun_it_suggests_goes_ahead(
    ray_cluster, teacher, corpus, tmp_path, capsys
):
    lines = corpus.read_text().splitlines()
    lines[2] = '{"id": "x", "text": null}'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    out = tmp_path / "cache"
    assert main(args(teacher, bad, out, "--on-bad-record", "error")) == 2
    error = one_line_error(capsys)
    assert error.endswith(
        "bad.jsonl: record 2: null text (pass --on-bad-record skip to skip and list such records)"
    )
    assert not list(out.glob("shard-*")) and not (out / "manifest.json").exists()
    # The stopped run left its settings but no shard: following its advice must not hit a wall.
    assert main(args(teacher, bad, out, "--on-bad-record", "skip")) == 0
    # With --ray-address unset Ray joins any local cluster: the log says which one.
    joined = r"Ray cluster at \S+: 1 node\(s\), \d+ CPU\(s\), 0 GPU\(s\)"
    assert re.search(joined, capsys.readouterr().err)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "x" in [s["doc_id"] for s in manifest["skipped"]]


def test_a_teacher_folder_without_a_tokenizer_asks_for_one(teacher, corpus, tmp_path, capsys):
    bare = tmp_path / "bare-teacher"
    shutil.copytree(teacher, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert main(args(bare, corpus, tmp_path / "cache")) == 2
    error = one_line_error(capsys)
    assert "bare-teacher holds no tokenizer" in error and "pass --tokenizer" in error


def test_a_second_run_on_a_locked_folder_refuses(teacher, corpus, tmp_path, capsys):
    out = tmp_path / "cache"
    with OutputLock(out):
        assert main(args(teacher, corpus, out)) == 2
    assert "is being written by another stage-1 run (pid" in capsys.readouterr().err
    assert not list(out.glob("shard-*"))


def test_input_errors_before_any_worker_starts(teacher, corpus, tmp_path, capsys):
    cases = {
        "does not exist (for a hub dataset": args(teacher, tmp_path / "none.jsonl", tmp_path / "o"),
        "less than max_length (64), not 64": [
            *args(teacher, corpus, tmp_path / "o"), "--stride", "64",
        ],
        "teacher './missing' does not exist": args("./missing", corpus, tmp_path / "o"),
    }  # fmt: skip
    broken = tmp_path / "broken"
    shutil.copytree(teacher, broken)
    (broken / "config.json").write_text("{not json")
    cases["cannot read the config of teacher"] = args(broken, corpus, tmp_path / "o")
    no_offsets = tmp_path / "no-offsets"
    shutil.copytree(teacher, no_offsets)
    (no_offsets / "tokenizer.json").unlink()
    (no_offsets / "tokenizer_config.json").write_text('{"tokenizer_class": "ByT5Tokenizer"}')
    cases["gives no character offsets"] = args(no_offsets, corpus, tmp_path / "o")
    garbled = tmp_path / "garbled"
    shutil.copytree(teacher, garbled)
    (garbled / "model.safetensors").write_bytes(b"\0" * 64)
    cases["model.safetensors are unreadable"] = args(garbled, corpus, tmp_path / "o")
    cases["--max-length 512 exceeds the teacher's context of 256 tokens"] = [
        *args(teacher, corpus, tmp_path / "o"), "--max-length", "512",
    ]  # fmt: skip
    cases["they do not belong together"] = [
        *args(teacher, corpus, tmp_path / "o"), "--tokenizer", "qwen2.5",
    ]  # fmt: skip
    cases["--tokenizer 'mistral' is not the tokenizer in the teacher's folder"] = [
        *args(teacher, corpus, tmp_path / "o"), "--tokenizer", "mistral",
    ]  # fmt: skip
    cases["profile_unit must be a unit's index (0 or more), not -1"] = [
        *args(teacher, corpus, tmp_path / "o"), "--profile-unit", "-1",
    ]  # fmt: skip
    for message, command in cases.items():
        assert main(command) == 2, message
        assert message in one_line_error(capsys)


def test_a_tokenizer_that_is_not_the_teachers_needs_force(teacher, corpus, tmp_path):
    from stage1_score.config import ScoreConfig
    from stage1_score.job import plan

    def planned(teacher_folder, *extra):
        argv = args(teacher_folder, corpus, tmp_path / "o", *extra)
        return plan(parse_config(ScoreConfig, argv, "", "stage1"))

    forced = planned(teacher, "--tokenizer", "mistral", "--force-tokenizer")
    assert forced.identity["tokenizer"]["source"] == "--tokenizer"
    # A folder with no tokenizer of its own: only the vocabulary sizes can disagree.
    bigger = make_tiny_teacher(tmp_path / "smollm2-teacher", "smollm2")
    bare = tmp_path / "bare"
    shutil.copytree(bigger, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(TeacherError, match="has 32000 tokens, the teacher's vocabulary 49152"):
        planned(bare, "--tokenizer", "tinyllama")
    assert planned(bare, "--tokenizer", "tinyllama", "--force-tokenizer").identity["tokenizer"]


@pytest.mark.slow
def test_weights_that_do_not_fit_fail_in_the_workers_with_one_line(
    ray_cluster, teacher, corpus, tmp_path, capsys
):
    """Readable weights of the wrong shape fail only when a worker loads them: the worker's
    own error still reaches the user as one line. Every tensor the model needs is there (the
    driver's check of tensor names passes), only their shapes differ."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    broken = tmp_path / "broken"
    shutil.copytree(teacher, broken)
    vocab = load_tokenizer(str(teacher)).vocab_size
    layers = AutoConfig.from_pretrained(teacher).num_hidden_layers
    shape = dict(hidden_size=48, num_attention_heads=2, num_hidden_layers=layers)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **shape))
    other.save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", broken / "model.safetensors")
    assert main(args(broken, corpus, tmp_path / "o", "--num-workers", "1")) == 2
    err = one_line_error(capsys)
    assert err.startswith("stage1: error: cannot load teacher")
    assert "ignore_mismatched_sizes" in err  # transformers' own error, raised in the worker


def test_run_py_works_as_a_script():
    result = subprocess.run(
        [sys.executable, str(REPO / "stage1_score" / "run.py"), "--help"],
        capture_output=True, text=True, cwd="/", check=True,
    )  # fmt: skip
    for flag in (
        "--teacher",
        "--corpus",
        "--docs-per-shard",
        "--max-length",
        "--stride",
        "--overwrite",
    ):
        assert flag in result.stdout


def test_a_profiled_unit_leaves_its_trace_and_the_cache_as_it_was(built, tmp_path, capsys):
    """--profile-unit K traces unit K's scoring (torch.profiler, Chrome's trace format) beside the
    cache: the trace holds the teacher's forward pass, the cache's files are byte for byte those
    of a run without it, and a rerun with nothing to score says why it left no trace."""
    built_out, command, first = built
    out = tmp_path / "profiled"
    profiled = [str(out) if arg == str(built_out) else arg for arg in command]
    assert main([*profiled, "--profile-unit", "1"]) == 0
    trace = out / profile_name(1)
    assert trace.name == "profile-unit-000001.json"
    assert f"unit 1's scoring traced in {trace}" in capsys.readouterr().err
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"aten::linear", "aten::embedding"} <= names, sorted(n for n in names if n)[:50]
    assert {name: data for name, data in snapshot(out).items() if name != trace.name} == first
    assert json.loads((out / "stage1-run.json").read_text())["config"]["profile_unit"] == 1

    trace.unlink()  # everything is cached now: the rerun scores nothing, so traces nothing
    assert main([*profiled, "--profile-unit", "1"]) == 0
    assert not trace.exists()
    assert "--profile-unit 1: unit 1 was already cached, so not scored again; no trace" in (
        capsys.readouterr().err
    )
    assert main([*profiled, "--profile-unit", "99"]) == 0
    units = len(json.loads((out / "manifest.json").read_text())["shards"])
    assert f"--profile-unit 99: the corpus has {units} units (0-{units - 1}); no trace" in (
        capsys.readouterr().err
    )
