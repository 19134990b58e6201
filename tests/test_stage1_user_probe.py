"""Stage 1 as a user meets it: a teacher folder missing most of its weights or holding no causal
LM, an --out inside the corpus, a cache or a .csv inside a corpus folder, a refused run's
leftovers, a rerun's run record, a document with no scored teacher token, and the message each
of these gives.

Every refusal here comes before any worker starts, so only the run-record test and the unscored
document's start Ray.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import zstandard
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from apps.cli import main as vocagno
from pipeline.cache.manifest import load_manifest
from pipeline.config import parse_config
from pipeline.log import configure
from pipeline.models.checkpoint import ModelError
from stage1_score.config import ScoreConfig
from stage1_score.job import plan
from stage1_score.run import main
from tests.cache_fixtures import build_cache
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus
from tests.test_stage1_run import ray_cluster  # noqa: F401 (a module-scoped fixture)

KEPT = ("model.embed_tokens.weight", "model.norm.weight")  # the tensors a partial teacher keeps


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", "tinyllama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl_corpus(
        tmp_path_factory.mktemp("corpus") / "docs.jsonl", shipped_documents(4)
    )


def command(teacher, corpus, out, *extra) -> list[str]:
    return ["--teacher", str(teacher), "--corpus", str(corpus), "--out", str(out),
            "--id-column", "id", "--max-length", "64", *extra]  # fmt: skip


def refusal(capsys) -> str:
    """The run's one-line error (the last line on stderr, no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(("stage1: error: ", "vocagno eval: error: ", "vocagno cache: error: "))
    return last


def tensor_names(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return sorted(handle.keys())


def with_tensors(teacher: Path, dest: Path, keep=None, add=None) -> Path:
    """A copy of `teacher` whose checkpoint holds only the tensors in `keep`, plus `add`."""
    shutil.copytree(teacher, dest)
    tensors = load_file(dest / "model.safetensors")
    if keep is not None:
        tensors = {name: t for name, t in tensors.items() if name in keep}
    save_file(tensors | (add or {}), dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_a_teacher_missing_most_of_its_weights_is_refused_naming_them(
    teacher, corpus, tmp_path, capsys
):
    """Today's failure: 18 of 20 tensors missing scored a cache with a mostly random model."""
    partial = with_tensors(teacher, tmp_path / "partial", keep=KEPT)
    every = tensor_names(teacher)  # the lm_head is tied: the checkpoint holds all 20 weights
    missing = sorted(set(every) - set(KEPT))
    out = tmp_path / "cache"
    assert main(command(partial, corpus, out)) == 2
    error = refusal(capsys)
    assert f"lacks {len(missing)} of the {len(every)} tensors the model needs" in error
    assert f"({', '.join(missing[:3])}, ...)" in error
    assert not out.exists()
    # One check for every model loaded from a folder: `vocagno eval` and stage 2's student.
    assert vocagno(["eval", "--model", str(partial), "--accuracy-problems", "0"]) == 2
    assert f"lacks {len(missing)} of the {len(every)} tensors" in refusal(capsys)
    from pipeline.models.student import build_student
    from pipeline.tokenizer import load_tokenizer

    with pytest.raises(ModelError, match=f"student '{partial}'.* lacks {len(missing)} of the"):
        build_student(str(partial), load_tokenizer("tinyllama"), seed=0, seq_len=64)


def test_tensors_the_model_does_not_use_are_named_in_a_warning(teacher, corpus, tmp_path, capsys):
    import torch

    extra = {"model.probe_extra.weight": torch.zeros(2)}
    folder = with_tensors(teacher, tmp_path / "extra", add=extra)
    configure()
    capsys.readouterr()
    plan(parse_config(ScoreConfig, command(folder, corpus, tmp_path / "o"), "", "stage1"))
    err = capsys.readouterr().err
    assert "holds 1 tensor(s) the model does not use, ignored: model.probe_extra.weight" in err


def test_a_config_that_makes_no_causal_lm_is_refused(teacher, corpus, tmp_path, capsys):
    """Today's failure: "model_type": "bert" scored a cache with a random, bidirectional
    BertLMHeadModel, exit 0."""
    from transformers import BertConfig, T5Config

    shape = dict(vocab_size=32000, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    configs = {
        "BertLMHeadModel that attends to every token": BertConfig(num_hidden_layers=2, **shape),
        "transformers has no causal-LM class for its config (model_type 't5')": T5Config(
            vocab_size=32000, d_model=32, num_layers=2, num_heads=2, d_ff=64
        ),
    }
    for message, config in configs.items():
        folder = tmp_path / config.model_type
        shutil.copytree(teacher, folder)
        config.save_pretrained(folder)
        out = tmp_path / f"cache-{config.model_type}"
        assert main(command(folder, corpus, out)) == 2
        error = refusal(capsys)
        assert f"teacher '{folder}' is not a causal language model" in error and message in error
        assert not out.exists()


def test_an_out_that_is_in_or_holds_the_corpus_is_refused(teacher, tmp_path, capsys):
    """Today's failure: the rerun read its own shards as corpus, and the --overwrite it then
    asked for deleted the valid cache."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl_corpus(folder / "docs.jsonl", shipped_documents(2))
    cases = {  # (corpus, out): how the message relates them
        (folder, folder / "cache"): "lies in",
        (folder, folder): "is",
        (folder / "docs.jsonl", folder): "holds",
        (f"{folder}/*.jsonl", folder / "nested" / "cache"): "lies in",
    }
    for (corpus, out), relation in cases.items():
        assert main(command(teacher, corpus, out)) == 2
        error = refusal(capsys)
        assert f"--out {out} {relation} the corpus" in error, error
        assert "give --out a folder apart from the corpus" in error
    assert sorted(p.name for p in folder.iterdir()) == ["docs.jsonl"]


def test_a_corpus_folder_skips_a_cache_in_it_and_names_the_files_it_ignores(
    teacher, tmp_path, capsys
):
    """Today's failure: a .csv beside the .jsonl was ignored without a word ("1 source(s)"),
    and a cache inside the folder was read as documents."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl_corpus(folder / "docs.jsonl", shipped_documents(2))
    (folder / "notes.csv").write_text("text\nnot read\n")
    build_cache(folder / "old-cache", num_documents=4, docs_per_shard=2)
    cache_files = sorted(p.name for p in (folder / "old-cache").iterdir())
    assert "manifest.json" in cache_files and "shard-000000.parquet" in cache_files
    configure()
    capsys.readouterr()
    job = plan(parse_config(ScoreConfig, command(teacher, folder, tmp_path / "o"), "", "stage1"))
    assert [source.name for source in job.corpus.sources] == ["docs.jsonl"]
    lines = [line for line in capsys.readouterr().err.splitlines() if "ignoring" in line]
    assert len(lines) == 1
    assert f"{len(cache_files)} files of a stage-1 cache in old-cache/" in lines[0]
    assert "1 file not of a corpus type" in lines[0] and lines[0].endswith(": notes.csv")


@pytest.mark.usefixtures("ray_cluster")
def test_an_out_holding_a_users_manifest_json_is_refused_naming_it(
    teacher, corpus, tmp_path, capsys
):
    """Before: `malformed manifest ('schema_version')`, as if it were a damaged cache, and
    --overwrite could not get past it. A damaged cache's own manifest still asks for --overwrite."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"name": "my dataset", "files": 3}')
    for extra in ((), ("--overwrite",)):
        assert main(command(teacher, corpus, mine, *extra)) == 2
        error = refusal(capsys)
        assert f"--out {mine} holds a manifest.json that is no stage-1 cache's" in error, error
        assert "never replaces a file it did not write, --overwrite included" in error
        assert "choose another --out" in error
        assert sorted(p.name for p in mine.iterdir()) == ["manifest.json"]
    cache = tmp_path / "cache"
    build_cache(cache, num_documents=2, docs_per_shard=2)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["shards"] = "damaged"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert main(command(teacher, corpus, cache)) == 2
    error = refusal(capsys)
    assert "malformed manifest" in error and error.endswith("pass --overwrite to replace the cache")
    assert main(command(teacher, corpus, cache, "--overwrite")) == 0
    assert load_manifest(cache).total_rows == 4


def test_a_refused_run_leaves_no_files_behind(teacher, tmp_path, capsys):
    """Today's failure: a new OUT holding .stage1.lock and producer.json, which `vocagno cache`
    took for a cache that stage 1 has not finished writing."""
    documents = shipped_documents(3)
    bad = write_jsonl_corpus(tmp_path / "bad.jsonl", documents[:2])
    bad.write_text(bad.read_text() + '{"id": "x", "text": null}\n')
    repeated = write_jsonl_corpus(tmp_path / "repeated.jsonl", [*documents, documents[0]])
    new = tmp_path / "a" / "b" / "cache"  # none of a/b/cache exists
    assert main(command(teacher, bad, new)) == 2
    assert "record 2: null text" in refusal(capsys)
    assert not (tmp_path / "a").exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("someone's")
    assert main(command(teacher, repeated, existing)) == 2
    assert "duplicate document id" in refusal(capsys)
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("case", "message", "not_the_old_one"),
    [
        ("max-length 0", "max_length must be at least 2", "gives no context length"),
        ("text in 'content'", "(pass --text-column content if that field holds the text)",
         "--on-bad-record skip"),
        ("text an int", "record 0: text is an int, not a string", "a int"),
    ],
)  # fmt: skip
def test_a_wrong_option_or_record_is_named_for_what_it_is(
    teacher, tmp_path, capsys, case, message, not_the_old_one
):
    corpus, extra = tmp_path / "docs.jsonl", []
    corpus.write_text('{"id": "a", "text": "Some text."}\n')
    if case == "max-length 0":
        extra = ["--max-length", "0"]
    elif case == "text in 'content'":
        corpus.write_text('{"id": "a", "content": "Some text."}\n')
    else:
        corpus.write_text('{"id": "a", "text": 7}\n')
    out = tmp_path / "cache"
    assert main(command(teacher, corpus, out, *extra)) == 2
    error = refusal(capsys)
    assert message in error and not_the_old_one not in error
    assert not out.exists()


def test_a_truncated_zstd_corpus_is_named_with_the_byte_it_ends_at(teacher, tmp_path, capsys):
    """Today's failure: "holds no documents", or "record 427: not valid JSON" where the cut
    fell after zstd's first 128 KiB block."""
    # Fewer documents than one unit holds (1,000): the corpus is read before any worker starts.
    documents = [(f"{i}-{j}", text) for j in range(40) for i, text in shipped_documents(24)]
    plain = write_jsonl_corpus(tmp_path / "docs.jsonl", documents).read_bytes()
    assert len(plain) > 3 * 128 * 1024  # several blocks: the cut leaves whole records before it
    packed = zstandard.ZstdCompressor().compress(plain)
    cut = tmp_path / "docs.jsonl.zst"
    cut.write_bytes(packed[: len(packed) * 3 // 4])
    out = tmp_path / "cache"
    assert main(command(teacher, cut, out)) == 2
    assert f"{cut}: truncated at byte {cut.stat().st_size}" in refusal(capsys)
    assert not out.exists()


def test_cache_verify_of_an_empty_folder_says_it_is_no_cache(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert vocagno(["cache", "verify", str(tmp_path / "empty")]) == 2
    error = refusal(capsys)
    assert error.endswith(f"{tmp_path / 'empty'} is not a cache: no manifest.json and no shards")
    unfinished = tmp_path / "unfinished"  # shards and no manifest: stage 1 stopped mid-way
    build_cache(unfinished, num_documents=2, docs_per_shard=1)
    (unfinished / "manifest.json").unlink()
    assert vocagno(["cache", "verify", str(unfinished)]) == 2
    assert "stage 1 has not finished writing this cache" in refusal(capsys)


def test_progress_lines_give_one_rate_a_real_eta_and_right_plurals(monkeypatch):
    """A fake clock: 100 s of start-up, then one unit of 10 documents and 1,000 tokens scored in
    10 s with half the corpus read. The rate is 1 document (100 tokens) per second of scoring,
    so the 30 documents left take 30 s; counted from the start it would read 330 s."""
    from pipeline.cache.manifest import ShardRecord
    from stage1_score import progress as module
    from stage1_score.output import Sidecar
    from stage1_score.units import WorkUnit
    from stage1_score.worker import UnitResult

    clock = [0.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    lines: list[str] = []
    progress = module.Progress(lambda: 0.5, every=15, emit=lines.append)
    for index in range(2):
        ids = [f"{index}-{i}" for i in range(10)]
        progress.planned(WorkUnit(index, ids, ids, ids, [], "", 0.5))
    clock[0] = 110.0
    sidecar = Sidecar(ShardRecord(0, "shard-000000.parquet", 10, 1000, 1, ""), "run", "unit", {})
    device = {"batches": 4, "in_batches_s": 9.0, "between_batches_s": 0.5, "before_first_s": None}
    progress.scored(UnitResult(sidecar=sidecar, seconds=10.0, worker=0, device=device))
    assert lines == [
        "1 unit done | 10 docs | 100 tok/s, 1.0 docs/s | 50% of corpus read | ETA 0m30s | "
        "workers: w0 100 tok/s | device time: 94.7% in batches, 5.3% idle between batches, 0.0% "
        "idle at units' edges"
    ]
    # A unit's edge is the wait since the worker's previous unit (its first has none).
    clock[0] = 120.0
    sidecar = Sidecar(ShardRecord(1, "shard-000001.parquet", 10, 1000, 1, ""), "run", "unit", {})
    device = device | {"in_batches_s": 8.5, "before_first_s": 1.5}
    progress.scored(UnitResult(sidecar=sidecar, seconds=10.0, worker=0, device=device))
    progress.report(final=True)
    assert lines[-1] == (
        "2 units done | 20 docs | 100 tok/s, 1.0 docs/s | finished in 2m00s | workers: w0 100 "
        "tok/s | device time: 87.5% in batches, 5.0% idle between batches, 7.5% idle at units' "
        "edges"
    )


@pytest.mark.usefixtures("ray_cluster")
def test_a_rerun_with_nothing_to_do_keeps_the_run_record(teacher, corpus, tmp_path, capsys):
    """Today's failure: the rerun replaced stage1-run.json with "units": {}, "workers": 0."""
    out = tmp_path / "cache"
    too_many = [*command(teacher, corpus, out), "--num-workers", "99"]
    assert main(too_many) == 2  # refused once Ray is joined: still nothing left behind
    assert "do not fit this Ray cluster" in refusal(capsys)
    assert not out.exists()
    run = [*command(teacher, corpus, out), "--num-workers", "1", "--docs-per-shard", "4"]
    assert main(run) == 0
    err = capsys.readouterr().err
    assert "1 unit done |" in err and f"wrote {out}: 1 shard, 4 documents," in err
    record = (out / "stage1-run.json").read_bytes()
    assert json.loads(record)["workers"] == 1 and list(json.loads(record)["units"]) == ["0"]
    assert main(run) == 0
    assert (out / "stage1-run.json").read_bytes() == record


@pytest.mark.usefixtures("ray_cluster")
def test_a_document_with_no_scored_teacher_token_is_warned_of_and_counted(tmp_path, capsys):
    """Under a teacher with no BOS (qwen2.5's tokenizer) a one-token document ("7") has no scored
    token: its first has no prediction. Before, the run and `cache stats` said nothing of it."""
    teacher = make_tiny_teacher(tmp_path / "qwen-teacher", "qwen2.5")
    documents = [("seven", "7"), *shipped_documents(2), ("x", "x")]
    corpus = write_jsonl_corpus(tmp_path / "docs.jsonl", documents)
    out = tmp_path / "cache"
    assert main([*command(teacher, corpus, out), "--num-workers", "1"]) == 0
    err = capsys.readouterr().err
    assert (
        "unit 0: 2 documents with no scored teacher token ('seven', 'x'): fewer than two teacher "
        "tokens, as the first has no prediction; stage 2 leaves their student tokens unmapped"
    ) in err
    assert "1 unit done | 4 docs (2 with no scored teacher token) |" in err
    assert vocagno(["cache", "stats", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unscored_documents"] == 2
    assert vocagno(["cache", "stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "documents        4 (+0 skipped; 2 with no scored teacher token)" in text


def test_an_error_in_a_worker_that_is_not_ours_is_one_line_naming_it():
    """Before: an exception a worker raised that is no VocagnoError (numpy refusing a seed, say)
    reached the user as Ray's remote traceback; it is one line naming it, as ours are."""
    import ray

    from stage1_score.pool import ScoringError, _unwrap

    cause = ValueError("expected non-negative integer\nmore detail")
    error = _unwrap(ray.exceptions.RayTaskError("score", "Traceback (most recent call...)", cause))
    assert isinstance(error, ScoringError)
    assert str(error) == (
        "a scoring worker failed (ValueError: expected non-negative integer); finished units are "
        "kept"
    )
