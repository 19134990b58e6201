"""What a stage-1 driver learns of its Ray cluster before joining it: the GPUs its workers will
get (--dtype auto), from a real cluster's GCS. Paths of a stage-1 job that `ray job submit
--working-dir` shipped, without a cluster: the driver finds itself in Ray's copy of the working
directory (Ray's job supervisor says so in the driver's environment), where the cache must not go,
from where a shipped teacher is opened in each worker's own copy, and whose corpus files the run
holds elsewhere before joining Ray deletes it. The cluster itself, where a real job must find its
shipped folder (it refuses --out there): tests/test_stage1_multinode.py (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.corpus import Corpus, CorpusOptions
from pipeline.errors import ConfigError
from stage1_score.cluster import (
    JOB_CONFIG_VARIABLE,
    cluster_gpus,
    corpus_kept_from_shipped,
    relative_to_shipped,
    shipped_working_dir,
)
from stage1_score.run import main
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus


@pytest.fixture
def shipped(tmp_path, monkeypatch) -> Path:
    """A driver started by Ray in its copy of a shipped working directory."""
    copy = tmp_path / "working_dir_files" / "_ray_pkg_0123"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    job_config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}}
    monkeypatch.setenv(JOB_CONFIG_VARIABLE, json.dumps(job_config))
    return copy.resolve()


def test_only_a_job_with_a_shipped_working_dir_has_one(tmp_path, monkeypatch):
    monkeypatch.delenv(JOB_CONFIG_VARIABLE, raising=False)
    assert shipped_working_dir() is None  # run directly, or with --ray-address
    monkeypatch.setenv(JOB_CONFIG_VARIABLE, json.dumps({"runtime_env": {}}))
    assert shipped_working_dir() is None  # `ray job submit` without --working-dir


def test_a_shipped_teacher_is_opened_in_each_workers_copy(shipped, tmp_path):
    assert shipped_working_dir() == shipped
    assert relative_to_shipped(shipped, shipped / "teacher") == Path("teacher")
    shared = tmp_path / "shared" / "teacher"
    assert relative_to_shipped(shipped, shared) == shared  # shared storage: as it is
    assert relative_to_shipped(None, shipped / "teacher") == shipped / "teacher"


def test_corpus_files_in_the_shipped_working_dir_outlive_its_deletion(shipped, tmp_path):
    """Joining Ray deletes the driver's copy of the working directory; the corpus files in it are
    held elsewhere for the run, under the same names (the same identity), and given back after."""
    documents = shipped_documents(6)
    (shipped / "corpus").mkdir()
    for part in range(3):
        write_jsonl_corpus(shipped / "corpus" / f"part-{part}.jsonl", documents[part::3])
    outside = write_jsonl_corpus(tmp_path / "outside.jsonl", documents)
    corpus, elsewhere = Corpus("corpus", CorpusOptions(id_column="id")), Corpus(outside)
    identity, texts = corpus.describe(), [d.text for d in corpus]
    with corpus_kept_from_shipped(shipped, corpus) as kept:
        assert kept == 3
        held = {source.path.parent.parent for source in corpus.sources}
        assert len(held) == 1 and not held.pop().is_relative_to(shipped)
        shutil.rmtree(shipped)  # what joining Ray does
        assert corpus.describe() == identity and [d.text for d in corpus] == texts
    assert not any(source.path.exists() for source in corpus.sources)  # nothing left behind
    with corpus_kept_from_shipped(shipped, elsewhere) as kept:  # read where it is
        assert kept == 0 and elsewhere.sources[0].path == outside


def test_an_output_in_the_shipped_working_dir_is_refused_in_one_line(shipped, tmp_path, capsys):
    make_tiny_teacher(shipped / "teacher", "tinyllama")
    write_jsonl_corpus(shipped / "corpus.jsonl", shipped_documents(3))
    command = ["--teacher", "teacher", "--corpus", "corpus.jsonl", "--id-column", "id"]
    assert main([*command, "--out", "cache"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"stage1: error: --out cache lies in the working directory Ray shipped for this job "
        f"({shipped}), a temporary copy on one node that is deleted when the job ends: give "
        "--out as an absolute path on storage that every node sees"
    )
    assert not (shipped / "cache").exists()  # refused before anything was written


# A Ray head in a process of its own, declaring GPUs it does not have (Ray takes the count on
# trust); it prints its address, then waits for its stdin to close.
GPU_CLUSTER_SCRIPT = """
import sys, ray
ray.init(address="local", num_cpus=1, num_gpus=2, include_dashboard=False, logging_level="ERROR")
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


def test_dtype_auto_asks_the_cluster_for_its_gpus_without_joining_it(monkeypatch):
    """Joining Ray from a `ray job submit` driver deletes its copy of the shipped working dir, so
    --dtype auto learns the workers' device from the cluster's GCS, as no driver."""
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    head = subprocess.Popen(
        [sys.executable, "-c", GPU_CLUSTER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        address = head.stdout.readline().strip()
        assert address, "the head printed no address"
        assert cluster_gpus(address) == 2
        assert not ray.is_initialized()  # asked, not joined
    finally:
        head.stdin.close()
        head.wait(timeout=120)
    with pytest.raises(ConfigError, match=r"--dtype auto cannot ask a Ray Client address"):
        cluster_gpus("ray://127.0.0.1:10001")
