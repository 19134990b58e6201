"""Stage 2 under `torchrun --nproc-per-node 2` (gloo on CPU), tiny Llama student on the real
tinyllama tokenizer: a run stopped at step 4 and resumed equals the uninterrupted run bit for bit,
every document is used once per epoch across the ranks, FSDP matches DDP, a 2-rank checkpoint
continues on 1 rank, and no process of the job imports a teacher backend or opens a teacher's
files.

Four torchrun launches in all (each costs several seconds of start-up on a small machine), so
the module is marked slow; the default run proves the same properties in-process
(test_stage2_train.py) and on the real 2-rank x 2-worker partition (test_stage2_data.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stage2_train.config import parse_train_config
from tests.cache_fixtures import build_cache, corpus_documents
from tests.stage2_runs import TRAIN, read_metrics, train_args
from tests.teacher_audit import assert_no_teacher, audited_env, fake_teacher

pytestmark = pytest.mark.slow


def run_args(cache: Path, out: Path, *extra: str) -> list[str]:
    return train_args(
        cache,
        out,
        "--max-steps",
        "8",
        "--global-batch-tokens",
        "256",
        "--num-workers",
        "1",
        "--selection-scope",
        "global",
        "--record-documents",
        *extra,
    )


def torchrun(
    args: list[str],
    env: dict | None = None,
    nproc: int = 2,
    launch: tuple[str, ...] = ("--standalone",),
) -> subprocess.Popen:
    """One torchrun launch (one node): `launch` says how it finds the others."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        "--nproc-per-node",
        str(nproc),
        str(TRAIN),
        *args,
    ]
    return subprocess.Popen(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


FAST_PATHS = ("--compile", "layers", "--loss-kernel", "chunked", "--adamw-kernel", "fused")
FSDP_BF16 = ("--fsdp", "--fsdp-param-dtype", "bfloat16")  # auto's choice on a GPU


def finish(process: subprocess.Popen) -> None:
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]


def epoch_args(cache: Path, out: Path, *extra: str) -> list[str]:
    """This module's runs: 4 micro-batches per rank per step, so that each rank's 8 steps take
    its consumer past its epoch 0. Documents packing at seq_len 32 splits almost every document
    and each continuation re-reads half a window of context, so an epoch costs about 2 slots
    per token: the ~800-token consumer needs 25 micro-batches of 2 x 32 (16 at run_args' 256
    tokens per step would leave it in epoch 0)."""
    return run_args(cache, out, "--global-batch-tokens", "512", *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("torchrun")
    teacher = root / "teacher"  # what the manifest names as the teacher; stage 2 must not touch it
    # 6 documents in 2 shards of ~510 and ~800 student tokens, one shard per data consumer in
    # epoch 0 (--data-consumers 2: consumer r is rank r's only one).
    documents = corpus_documents(6)
    cache = root / "cache"
    build_cache(cache, documents=documents, docs_per_shard=3, teacher=fake_teacher(teacher))
    audited = audited_env(root)
    whole, parts, sharded = root / "whole", root / "parts", root / "fsdp"
    fast = root / "fast"  # the GPU path's switches that run on a CPU, under DDP
    half, half_parts = root / "fsdp-bf16", root / "fsdp-bf16-parts"  # FSDP2 bfloat16 parameters
    # The uninterrupted runs, the first halves of the stopped ones, an FSDP run and the fast
    # paths share the machine.
    first = [
        torchrun(epoch_args(cache, whole)),
        torchrun(epoch_args(cache, parts, "--stop-at-step", "4")),
        torchrun(epoch_args(cache, sharded, "--fsdp", "--save-every", "4")),
        torchrun(epoch_args(cache, fast, *FAST_PATHS)),
        torchrun(epoch_args(cache, half, *FSDP_BF16)),
        torchrun(epoch_args(cache, half_parts, *FSDP_BF16, "--stop-at-step", "4")),
    ]
    for process in first:
        finish(process)
    stopped_metrics = (parts / "metrics.jsonl").read_text()
    resumed = [
        torchrun(epoch_args(cache, parts), env=audited),
        torchrun(epoch_args(cache, half_parts, *FSDP_BF16)),
    ]
    for process in resumed:
        finish(process)
    return {
        "cache": cache,
        "whole": whole,
        "parts": parts,
        "fsdp": sharded,
        "fast": fast,
        "fsdp-bf16": half,
        "fsdp-bf16-parts": half_parts,
        "teacher": teacher,
        "root": root,
        "documents": documents,
        "stopped_metrics": stopped_metrics,
    }


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict:
    """FSDP with the plain path, with activation checkpointing, and with its layers compiled and
    the chunked loss, whole and stopped at step 4 then resumed, and once more with checkpointing
    (their own cache: `runs`'s launches need not run with them)."""
    root = tmp_path_factory.mktemp("fsdp")
    cache = root / "cache"
    build_cache(cache, documents=corpus_documents(6), docs_per_shard=3)
    fast = ("--fsdp", "--compile", "layers", "--loss-kernel", "chunked")
    plain, whole, parts = root / "plain", root / "whole", root / "parts"
    checkpointed, fast_checkpointed = root / "checkpointed", root / "fast-checkpointed"
    for process in [
        torchrun(epoch_args(cache, plain, "--fsdp")),
        torchrun(epoch_args(cache, checkpointed, "--fsdp", "--activation-checkpointing")),
        torchrun(epoch_args(cache, fast_checkpointed, *fast, "--activation-checkpointing")),
        torchrun(epoch_args(cache, whole, *fast)),
        torchrun(epoch_args(cache, parts, *fast, "--stop-at-step", "4")),
    ]:
        finish(process)
    finish(torchrun(epoch_args(cache, parts, *fast)))
    return {"plain": plain, "whole": whole, "parts": parts, "checkpointed": checkpointed,
            "fast-checkpointed": fast_checkpointed}  # fmt: skip


def test_fsdp_with_compiled_layers_and_the_chunked_loss_trains_and_resumes_bit_for_bit(
    fsdp_runs,
):
    """--fsdp --compile layers --loss-kernel chunked (the chunked loss runs inside the model's
    forward pass, where the sharded head's weight is whole): the plain FSDP run's trajectory up
    to float rounding, the same tokens kept, and stopped at step 4 and resumed it equals its
    uninterrupted self bit for bit."""
    fast, plain = read_metrics(fsdp_runs["whole"]), read_metrics(fsdp_runs["plain"])
    for a, b in zip(fast, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["kept_fraction"] == b["kept_fraction"]
    saved = json.loads((fsdp_runs["whole"] / "config.json").read_text())
    assert [saved["resolved_compile"], saved["resolved_loss_kernel"]] == ["layers", "chunked"]
    assert read_metrics(fsdp_runs["parts"]) == fast
    assert (fsdp_runs["parts"] / "final" / "model.safetensors").read_bytes() == (
        fsdp_runs["whole"] / "final" / "model.safetensors"
    ).read_bytes()


def test_fsdp_with_activation_checkpointing_trains_the_same_bits(fsdp_runs):
    """--activation-checkpointing under FSDP (its gathering hooks outside each layer's checkpoint)
    recomputes the same kernels on the same inputs: the plain FSDP run exactly, and with compiled
    layers and the chunked loss the same run without checkpointing exactly."""
    for ours, theirs in (("checkpointed", "plain"), ("fast-checkpointed", "whole")):
        assert read_metrics(fsdp_runs[ours]) == read_metrics(fsdp_runs[theirs]), ours
        assert (fsdp_runs[ours] / "final" / "model.safetensors").read_bytes() == (
            fsdp_runs[theirs] / "final" / "model.safetensors"
        ).read_bytes()


def test_stopped_and_resumed_2_rank_run_is_bit_identical(runs):
    assert len(runs["stopped_metrics"].splitlines()) == 4
    assert [m["step"] for m in read_metrics(runs["whole"])] == list(range(1, 9))
    assert read_metrics(runs["parts"]) == read_metrics(runs["whole"])
    for name in ("rank-0.jsonl", "rank-1.jsonl"):  # the same documents at the same steps
        assert (runs["parts"] / "documents" / name).read_text() == (
            runs["whole"] / "documents" / name
        ).read_text()
    assert (runs["parts"] / "final" / "model.safetensors").read_bytes() == (
        runs["whole"] / "final" / "model.safetensors"
    ).read_bytes()


def test_every_document_is_used_exactly_once_per_epoch_across_ranks(runs):
    """Each rank reads one consumer's stream: in it, no document is begun twice in one epoch and
    every document of its epoch 0 is begun before any of epoch 1; the two ranks' epoch 0 parts
    are disjoint and together every document of the cache."""
    epoch_zero = []
    for rank in (0, 1):
        lines = (runs["whole"] / "documents" / f"rank-{rank}.jsonl").read_text().splitlines()
        entries = [tuple(d) for line in lines for d in json.loads(line)["documents"]]
        epochs = [epoch for epoch, _ in entries]
        assert max(epochs) >= 1, f"rank {rank} did not finish its epoch 0: {entries}"
        assert epochs == sorted(epochs), f"rank {rank} began an epoch before the last one ended"
        assert len(set(entries)) == len(entries), f"rank {rank} began a document twice in an epoch"
        epoch_zero += [doc_id for epoch, doc_id in entries if epoch == 0]
    assert sorted(epoch_zero) == sorted(doc_id for doc_id, _ in runs["documents"])


def test_fsdp_trains_the_same_model_sharded(runs):
    """FSDP (fully_shard per decoder layer, gloo on CPU) computes what DDP computes: the same
    first-step loss, and a trajectory equal up to float summation order; its checkpoints hold
    one shard per rank, and its final model is a whole Hugging Face model."""
    import torch
    from transformers import AutoModelForCausalLM

    sharded, replicated = read_metrics(runs["fsdp"]), read_metrics(runs["whole"])
    assert sharded[0]["loss"] == pytest.approx(replicated[0]["loss"], rel=1e-6)
    for a, b in zip(sharded, replicated, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["kept_fraction"] == b["kept_fraction"]
    for step in (4, 8):
        shards = sorted((runs["fsdp"] / "checkpoints" / f"step-{step}" / "state").glob("*.distcp"))
        assert len(shards) == 2
    a = AutoModelForCausalLM.from_pretrained(runs["fsdp"] / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(runs["whole"] / "final").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4)


def test_fsdp_with_bfloat16_parameters_trains_the_float32_trajectory_and_resumes_exactly(runs):
    """--fsdp-param-dtype bfloat16 (FSDP2's MixedPrecisionPolicy: bfloat16 all-gathers and
    compute, float32 gradient reduction and weights): the float32 FSDP run's trajectory within
    bfloat16 rounding (measured: losses within 4e-4 and gradient norms within 4e-3 relative over
    8 steps), not the same numbers (the policy is in effect), and a stopped and resumed run equals
    the uninterrupted one bit for bit."""
    half, whole = read_metrics(runs["fsdp-bf16"]), read_metrics(runs["fsdp"])
    assert half[0]["loss"] != whole[0]["loss"]
    for a, b in zip(half, whole, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=3e-2)
        assert a["kept_fraction"] == b["kept_fraction"]
    assert read_metrics(runs["fsdp-bf16-parts"]) == half
    saved = json.loads((runs["fsdp-bf16"] / "config.json").read_text())
    assert saved["resolved_fsdp_param_dtype"] == "bfloat16"
    assert json.loads((runs["fsdp"] / "config.json").read_text())["resolved_fsdp_param_dtype"] == (
        "float32"
    )


def test_the_fast_paths_train_under_ddp_what_the_plain_run_does(runs):
    """--compile layers, --loss-kernel chunked (the head's gradient reaches DDP's reducer from
    outside the model's forward pass) and fused AdamW on 2 ranks: the plain run's trajectory up
    to float rounding, the same tokens kept."""
    fast, plain = read_metrics(runs["fast"]), read_metrics(runs["whole"])
    for a, b in zip(fast, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["kept_fraction"] == b["kept_fraction"]
    saved = json.loads((runs["fast"] / "config.json").read_text())
    resolved = [saved[f"resolved_{name}"] for name in ("compile", "loss_kernel", "adamw_kernel")]
    assert resolved == ["layers", "chunked", "fused"]


# torchrun's ranks run one torch thread each and this process may run more: the resume says so
# (its own test: test_stage2_train.py), and the comparison below is up to summation order
@pytest.mark.filterwarnings("ignore:checkpoint .* torch threads:UserWarning")
def test_a_2_rank_checkpoint_resumes_on_1_rank(runs, tmp_path):
    """Step 4 of the stopped 2-rank run (2 data consumers) continues in one process: every step
    trains on the documents the 2-rank run's step did; the first resumed step's loss over all
    tokens equals it up to summation order (later ones differ: --selection-scope global ranks
    both ranks' micro-batches together)."""
    from stage2_train.checkpoint import step_dir
    from stage2_train.trainer import train

    out = tmp_path / "out"
    shutil.copytree(runs["parts"], out)
    shutil.rmtree(step_dir(out, 8))
    shutil.rmtree(out / "final")
    (out / "documents" / "rank-1.jsonl").unlink()  # what rank 1 began is in rank 0's log now
    train(parse_train_config(epoch_args(runs["cache"], out)))
    mine = [json.loads(line)["documents"] for line in (out / "documents" / "rank-0.jsonl").open()]
    theirs = [
        sorted(a + b)
        for a, b in zip(
            *[
                [json.loads(line)["documents"] for line in (runs["whole"] / "documents" / n).open()]
                for n in ("rank-0.jsonl", "rank-1.jsonl")
            ],
            strict=True,
        )
    ]
    assert [sorted(docs) for docs in mine[4:]] == theirs[4:]
    got, want = read_metrics(out), read_metrics(runs["whole"])
    assert got[:4] == want[:4] and [m["step"] for m in got] == list(range(1, 9))
    assert got[4]["loss_all"] == pytest.approx(want[4]["loss_all"], rel=1e-5)


def test_no_process_imports_a_teacher_backend_or_opens_teacher_files(runs):
    assert_no_teacher(runs["root"], runs["teacher"], runs["parts"], ranks=2)
