"""Stage 2 under real faults: a checkpoint save that crashed half-way, a stop signal (SIGINT,
SIGTERM) that saves where it stopped, a training process SIGKILLed mid-run, and a torchrun rank
SIGKILLed mid-run. Resuming with --resume auto continues from the last complete checkpoint and
reproduces the uninterrupted run's per-step metrics bit for bit.

Covered elsewhere, cited in docs/fault-tolerance.md: resuming with another world size and a node
of a two-node job killed (test_stage2_elastic.py), resuming with another cache or settings
(test_stage2_train.py::test_resume_refuses_other_settings_other_cache_and_never), and which
folders count as checkpoints (test_stage2_train.py::test_incomplete_checkpoints_are_never_resumed).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from stage2_train.checkpoint import MARKER, complete_checkpoints, step_dir
from stage2_train.train import main
from tests.cache_fixtures import build_cache, corpus_documents
from tests.stage2_runs import TRAIN, read_metrics, train_args
from tests.test_fault_stage1 import act_while_stopped
from tests.test_stage2_torchrun import finish, run_args, torchrun

SAVE_ARGS = (
    "--max-steps", "8", "--save-every", "2", "--num-workers", "0", "--global-batch-tokens", "64",
)  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=12, docs_per_shard=6)
    return path


@pytest.fixture(scope="module")
def whole(cache, tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("whole") / "out"
    assert main(train_args(cache, out, *SAVE_ARGS)) == 0
    return out


def assert_same_run(out: Path, whole: Path) -> None:
    assert read_metrics(out) == read_metrics(whole)  # floats compared exactly
    assert (out / "final" / "model.safetensors").read_bytes() == (
        whole / "final" / "model.safetensors"
    ).read_bytes()


def test_a_crash_during_a_checkpoint_save_resumes_from_the_previous_one(cache, whole, tmp_path):
    out = tmp_path / "out"
    assert main(train_args(cache, out, *SAVE_ARGS, "--stop-at-step", "4")) == 0
    assert [s for s, _ in complete_checkpoints(out)] == [2, 4]
    # What a crash while saving step 4 leaves: the unrenamed partial folder, no marker, a torn
    # file; and metrics.jsonl already holding steps 3 and 4.
    partial = step_dir(out, 4).with_name(".step-4.partial")
    step_dir(out, 4).rename(partial)
    (partial / MARKER).unlink()
    torn = sorted((partial / "state").iterdir())[0]
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]

    assert main(train_args(cache, out, *SAVE_ARGS)) == 0  # --resume auto: from step 2
    assert_same_run(out, whole)
    assert not partial.exists()  # the torn save was replaced by a complete step 4
    assert (step_dir(out, 4) / MARKER).exists()


def wait_until(condition, process: subprocess.Popen, output, timeout: float = 300.0) -> None:
    """Poll `condition` until it holds; fail if `process` ends first (with `output()`)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, output()[-3000:]
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s"
        time.sleep(0.01)


def saved_mid_run(out: Path, steps: int):
    """A condition: a checkpoint is complete and the step in flight is not the last of `steps`
    (at most steps - 2 logged), so that a kill lands before the schedule ends; a rank left alone
    cannot finish a step, which needs the other's collectives."""

    def condition() -> bool:
        if not complete_checkpoints(out):
            return False
        return (out / "metrics.jsonl").read_text().count("\n") <= steps - 2

    return condition


def test_a_training_process_killed_mid_run_resumes_bit_identical(cache, whole, tmp_path):
    out, log = tmp_path / "out", tmp_path / "killed.log"
    command = [sys.executable, str(TRAIN), *train_args(cache, out, *SAVE_ARGS)]
    with log.open("w") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
        )  # the pytest process's thread count: resuming on another one is not bit-identical
        act_while_stopped(
            [process.pid],
            saved_mid_run(out, 8),
            lambda: process.send_signal(signal.SIGKILL),
            "a checkpoint mid-run",
            process,
            log.read_text,
            timeout=300,
        )
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not (out / "final").exists()  # killed before the schedule ended
    assert complete_checkpoints(out)[-1][0] < 8
    assert main(train_args(cache, out, *SAVE_ARGS)) == 0  # --resume auto
    assert_same_run(out, whole)
    assert not list((out / "checkpoints").glob(".*.partial"))


def rank_processes(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The ranks torchrun started: its own children (their data-loader workers, forked from them,
    share their RANK and command line)."""
    found = {}
    for child in launcher.children():
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "train.py" in " ".join(child.cmdline()):
            found[int(rank)] = child
    return found


@pytest.mark.slow
def test_a_rank_killed_mid_run_resumes_bit_identical(tmp_path):
    """Two torchrun launches side by side (uninterrupted, killed), then the resume."""
    cache, whole, out = tmp_path / "cache", tmp_path / "whole", tmp_path / "out"
    build_cache(cache, documents=corpus_documents(6), docs_per_shard=3)
    extra = ("--max-steps", "16", "--save-every", "4")
    uninterrupted = torchrun(run_args(cache, whole, *extra))
    killed = torchrun(run_args(cache, out, *extra))
    launcher = psutil.Process(killed.pid)

    def wait(condition) -> None:
        wait_until(condition, killed, lambda: killed.communicate()[0], timeout=600)

    wait(lambda: len(rank_processes(launcher)) == 2)
    ranks = rank_processes(launcher)
    # Both ranks stopped: no step or checkpoint can complete between the look and the kill.
    act_while_stopped(
        [rank.pid for rank in ranks.values()],
        saved_mid_run(out, 16),
        lambda: ranks[1].send_signal(signal.SIGKILL),
        "a checkpoint mid-run",
        killed,
        lambda: killed.communicate()[0],
        timeout=600,
    )
    output, _ = killed.communicate(timeout=300)
    finish(uninterrupted)
    assert killed.returncode != 0, output[-3000:]  # torchrun stops the job when a rank dies
    assert not (out / "final").exists()  # killed before the schedule ended
    steps_done = complete_checkpoints(out)[-1][0]
    assert steps_done < 16

    finish(torchrun(run_args(cache, out, *extra)))  # --resume auto
    assert read_metrics(out) == read_metrics(whole)
    for name in ("rank-0.jsonl", "rank-1.jsonl"):  # the same documents at the same steps
        assert (out / "documents" / name).read_text() == (whole / "documents" / name).read_text()
    assert (out / "final" / "model.safetensors").read_bytes() == (
        whole / "final" / "model.safetensors"
    ).read_bytes()
    assert not list((out / "checkpoints").glob(".*.partial"))


@pytest.mark.parametrize(
    ("signum", "send"),
    [
        (signal.SIGINT, lambda p, s: os.killpg(p.pid, s)),  # Ctrl-C: the terminal's whole group
        (signal.SIGTERM, lambda p, s: p.send_signal(s)),  # Slurm, Kubernetes, `kill`
    ],
)
def test_a_stop_signal_saves_a_checkpoint_and_the_resumed_run_is_bit_identical(
    cache, whole, tmp_path, signum, send
):
    out, log = tmp_path / "out", tmp_path / "stopped.log"
    command = [sys.executable, str(TRAIN), *train_args(cache, out, *SAVE_ARGS)]
    with log.open("w") as output:
        run = subprocess.Popen(command, stderr=output, start_new_session=True)

    def early() -> bool:
        """The header is out (the stop handler is installed; the metrics log exists) and at most
        5 of the 8 steps are logged: a step reads the stop request at its end, so the run stops
        after step 7 at the latest."""
        if not re.search(r"^stage 2:", log.read_text(), re.MULTILINE):
            return False
        return (out / "metrics.jsonl").read_text().count("\n") <= 5

    act_while_stopped(
        [run.pid], early, lambda: send(run, signum), "the header early in the run", run,
        log.read_text, timeout=300,
    )  # fmt: skip
    run.wait(timeout=300)
    err = log.read_text()
    assert run.returncode == 128 + signum, err
    assert "Traceback" not in err
    # saved where it stopped (after the saves of every second step before it), not at the end
    said = re.search(r"stopped by request after step (\d+), saved in ", err)
    assert said, err
    assert int(said[1]) < 8 and complete_checkpoints(out)[-1][0] == int(said[1]), err
    assert main(train_args(cache, out, *SAVE_ARGS)) == 0
    assert_same_run(out, whole)


def test_a_killed_data_loader_worker_ends_the_run_in_one_line_that_says_how_to_go_on(
    cache, whole, tmp_path
):
    """A worker SIGKILLed (as the kernel's OOM killer does) mid-run: one line, exit 2, and the
    rerun it suggests resumes to the uninterrupted run's losses."""
    out, log = tmp_path / "out", tmp_path / "killed.log"
    args = (*SAVE_ARGS, "--num-workers", "2")
    command = [sys.executable, str(TRAIN), *train_args(cache, out, *args)]
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        trainer = psutil.Process(process.pid)
        act_while_stopped(
            [process.pid],
            saved_mid_run(out, 8),
            lambda: trainer.children()[0].send_signal(signal.SIGKILL),
            "a checkpoint mid-run with its workers running",
            process,
            log.read_text,
            timeout=300,
        )
        process.wait(timeout=60)
    said = log.read_text()
    assert process.returncode == 2, said
    errors = [line for line in said.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in said, said
    assert "a data-loader worker died (" in errors[0]  # torch's reason, or its queue's
    assert "run the same command to resume from the last one" in errors[0]
    assert main(train_args(cache, out, *args)) == 0
    assert read_metrics(out) == read_metrics(whole)  # workers never change the stream
