"""Stage 2 on a changing cluster (gloo on CPU, the tiny Llama student of tests/stage2_runs.py):

- a run checkpointed on 4 ranks resumes on 2, and one checkpointed on 2 resumes on 4 (DDP; and
  FSDP from 2 to 4): model and optimizer reshard through torch.distributed.checkpoint, and every
  global step trains on exactly the documents the uninterrupted 4-rank run's step trains on (none
  twice, none lost), with the same losses up to float summation order (the same micro-batches'
  gradients are summed on other ranks);
- the same with a second teacher's cache (--more-caches), from 2 ranks to 4;
- `--nnodes 2`: two torchrun launches on one machine meet through a c10d rendezvous, each "node"
  with its own scratch (TMPDIR); one node is SIGKILLed after a checkpoint, both are relaunched,
  and the run resumes bit-identical to an undisturbed single-launch run of the same world size.

Many torchrun launches on a small machine: slow.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from stage2_train.checkpoint import complete_checkpoints
from tests.cache_fixtures import build_cache, corpus_documents
from tests.stage2_runs import read_metrics
from tests.test_stage2_torchrun import finish, run_args, torchrun

pytestmark = pytest.mark.slow

# 4 consumers (divisible by 1, 2 and 4 ranks), 4 micro-batches of 2 x 64 tokens per step (8 steps
# pass the cache's ~2,500 tokens), top-k per micro-batch (a global threshold would rank other sets
# of tokens together on another world size).
ELASTIC = (
    "--data-consumers", "4", "--selection-scope", "microbatch", "--guidance", "token",
    "--seq-len", "64", "--global-batch-tokens", "512",
)  # fmt: skip


def step_documents(out: Path) -> list[list]:
    """The documents each step began, over all ranks (order within a step is the ranks')."""
    steps: dict[int, list] = {}
    for log in sorted((out / "documents").glob("rank-*.jsonl")):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(map(tuple, record["documents"]))
    return [sorted(steps[step]) for step in sorted(steps)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, documents=corpus_documents(12), docs_per_shard=4)
    return path


def test_a_checkpoint_resumes_on_another_world_size_reading_each_document_once(cache, tmp_path):
    whole, shrunk, grown = tmp_path / "whole", tmp_path / "4-then-2", tmp_path / "2-then-4"
    first = [
        torchrun(run_args(cache, whole, *ELASTIC), nproc=4),
        torchrun(run_args(cache, shrunk, *ELASTIC, "--stop-at-step", "4"), nproc=4),
    ]
    for process in first:
        finish(process)
    finish(torchrun(run_args(cache, grown, *ELASTIC, "--stop-at-step", "4"), nproc=2))
    resumed = [
        torchrun(run_args(cache, shrunk, *ELASTIC), nproc=2),
        torchrun(run_args(cache, grown, *ELASTIC), nproc=4),
    ]
    for process in resumed:
        finish(process)

    reference = read_metrics(whole)
    documents = step_documents(whole)
    assert len(documents) == 8 and sum(map(len, documents)) >= 8  # documents begun per step
    for out in (shrunk, grown):
        assert step_documents(out) == documents  # each step: the same documents, once
        assert len(list((out / "documents").glob("rank-*.jsonl"))) == 4
        for got, want in zip(read_metrics(out), reference, strict=True):
            assert got["kept_fraction"] == want["kept_fraction"]
            assert got["loss_all"] == pytest.approx(want["loss_all"], rel=1e-4)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    # The 2-rank half was a 2-rank run: its first steps are the 4-rank run's up to summation order.
    assert (
        json.loads((grown / "checkpoints" / "step-4" / "checkpoint.json").read_text())["world_size"]
        == 2
    )


def test_an_fsdp_checkpoint_reshards_from_2_ranks_to_4(cache, tmp_path):
    """FSDP's sharded model and optimizer state, saved by 2 ranks, is loaded by 4: the steps after
    it train on the same documents with the losses of the undisturbed (4-rank DDP) run, up to
    summation order."""
    whole, out = tmp_path / "whole", tmp_path / "fsdp"
    undisturbed = torchrun(run_args(cache, whole, *ELASTIC), nproc=4)
    finish(torchrun(run_args(cache, out, *ELASTIC, "--fsdp", "--stop-at-step", "4"), nproc=2))
    finish(undisturbed)
    assert len(list((out / "checkpoints" / "step-4" / "state").glob("*.distcp"))) == 2
    finish(torchrun(run_args(cache, out, *ELASTIC, "--fsdp"), nproc=4))
    assert step_documents(out) == step_documents(whole)
    for got, want in zip(read_metrics(out), read_metrics(whole), strict=True):
        assert got["kept_fraction"] == want["kept_fraction"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)


def test_a_two_teacher_run_resumes_on_another_world_size(cache, tmp_path):
    """--more-caches are read in step with the cache's plan: a 2-rank checkpoint of a run with a
    second teacher (another tokenizer) continues on 4 ranks with the documents and losses of the
    undisturbed 4-rank run."""
    other = tmp_path / "second-teacher"
    build_cache(other, teacher_tokenizer="smollm2", documents=corpus_documents(12),
                docs_per_shard=4, seed=7)  # fmt: skip
    two = (*ELASTIC, "--more-caches", str(other))
    whole, out = tmp_path / "whole", tmp_path / "2-then-4"
    undisturbed = torchrun(run_args(cache, whole, *two), nproc=4)
    finish(torchrun(run_args(cache, out, *two, "--stop-at-step", "4"), nproc=2))
    finish(undisturbed)
    finish(torchrun(run_args(cache, out, *two), nproc=4))
    assert step_documents(out) == step_documents(whole)
    for got, want in zip(read_metrics(out), read_metrics(whole), strict=True):
        assert got["kept_fraction"] == want["kept_fraction"]
        assert got["mapped_fraction"] == want["mapped_fraction"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)


@pytest.fixture
def rendezvous() -> Iterator[str]:
    """The c10d rendezvous endpoint: a store this process hosts on a port the system picks, bound
    from the start and held until the test ends (a probed free port could be taken before a node
    binds it). The nodes join it as clients, as they would a cluster's rendezvous host."""
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    yield f"localhost:{store.port}"
    del store  # stops the server


@pytest.fixture
def scratch():
    """A short folder for the nodes' scratch: data-loader workers hand batches over through Unix
    sockets in TMPDIR, whose paths may not exceed 107 bytes (pytest's tmp_path is too deep)."""
    root = tempfile.mkdtemp(prefix="elastic-")
    yield Path(root)
    shutil.rmtree(root, ignore_errors=True)


def two_nodes(args: list[str], scratch: Path, endpoint: str) -> list:
    """`--nnodes 2` as two torchrun launches (one rank each) meeting at the c10d rendezvous
    `endpoint`, each node with its own scratch folder. A new rendezvous id per launch: the store
    outlives a launch, and a relaunch must not meet the state of the one before."""
    run_id = uuid.uuid4().hex
    nodes = []
    for node in (0, 1):
        node_scratch = tempfile.mkdtemp(prefix=f"node-{node}-", dir=scratch)
        launch = (
            "--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-conf", "is_host=false", "--rdzv-id", run_id,
            "--max-restarts", "0",
        )  # fmt: skip
        env = {"TMPDIR": node_scratch}
        nodes.append(torchrun(args, env, 1, launch))
    return nodes


def test_two_nodes_one_killed_then_both_relaunched_resume_bit_identical(
    cache, tmp_path, scratch, rendezvous
):
    extra = ("--max-steps", "12", "--save-every", "4")
    single, out = tmp_path / "single-launch", tmp_path / "two-nodes"
    undisturbed = torchrun(run_args(cache, single, *extra))  # --standalone, 2 ranks
    nodes = two_nodes(run_args(cache, out, *extra), scratch, rendezvous)
    deadline = time.monotonic() + 600
    while not complete_checkpoints(out):
        assert all(node.poll() is None for node in nodes), nodes[0].communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    agent = psutil.Process(nodes[1].pid)
    for process in [agent, *agent.children(recursive=True)]:  # the node: agent, rank, workers
        process.send_signal(signal.SIGKILL)
    for node in nodes:
        node.communicate(timeout=300)
    assert nodes[0].returncode != 0  # the surviving node's rank loses its peer and stops
    assert not (out / "final").exists()  # killed before the schedule ended
    assert complete_checkpoints(out)[-1][0] < 12
    finish(undisturbed)

    for node in two_nodes(run_args(cache, out, *extra), scratch, rendezvous):
        finish(node)
    assert read_metrics(out) == read_metrics(single)
    assert (out / "final" / "model.safetensors").read_bytes() == (
        single / "final" / "model.safetensors"
    ).read_bytes()
    assert step_documents(out) == step_documents(single)
    # Shared files are one writer's each: rank 0's logs, one documents log and one checkpoint
    # file per rank; nothing of a node's own lands in the shared folder.
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {f for f in files if f.startswith("documents/")} == {
        "documents/rank-0.jsonl",
        "documents/rank-1.jsonl",
    }
    step = complete_checkpoints(out)[-1][1]
    assert sorted(p.name for p in step.iterdir()) == [
        "COMPLETE", "checkpoint.json", "config.json", "rank-0.pt", "rank-1.pt", "state",
        "trainer.pt",
    ]  # fmt: skip
    assert not [f for f in files if "torchelastic" in f or f.endswith(".tmp")]
