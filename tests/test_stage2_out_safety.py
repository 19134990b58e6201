"""--out belongs to stage 2 alone and to one run at a time (issue #26): a folder holding anything
stage 2 did not write (the student model, a cache, someone's files) is refused before a byte is
written; a second run on a folder in use is refused naming the first; a damaged local shard is
refused before OUT exists; a refused run leaves nothing behind; and a rerun of the same command on
its own OUT continues as before. Each case runs the command as a user would (in-process `main`,
the concurrent run as a real second process)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.cache.schema import shard_name
from stage2_train.checkpoint import complete_checkpoints
from stage2_train.output import LOCK_NAME
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import TRAIN, read_metrics, train_args

PREFIX = "stage2_train/train.py: error: "
QUICK = ("--max-steps", "2", "--num-workers", "0")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=4)
    return path


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path below `folder` with its bytes (None for a folder)."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def refusal(capsys) -> str:
    """The run's one line of output: its error."""
    captured = capsys.readouterr()
    text = (captured.out + captured.err).strip()
    assert "Traceback" not in text and "\n" not in text, text
    assert text.startswith(PREFIX), text
    return text.removeprefix(PREFIX)


def save_tiny_model(folder: Path) -> None:
    """A Hugging Face model folder (config.json, weights) of the tinyllama tokenizer's size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.mark.parametrize("out_is", ["the student folder", "a parent of the student folder"])
def test_out_at_the_student_model_is_refused_and_the_model_is_untouched(
    cache, tmp_path, capsys, out_is
):
    student = tmp_path / "models" / "student"
    save_tiny_model(student)
    out = student if out_is == "the student folder" else student.parent
    before = snapshot(tmp_path / "models")
    args = train_args(cache, out, *QUICK)
    args[args.index("--student") + 1] = str(student)
    capsys.readouterr()
    assert main(args) == 2
    message = refusal(capsys)
    holds = "is" if out == student else "holds"
    assert message.startswith(f"--out {out} {holds} the student's folder (--student {student})")
    assert snapshot(tmp_path / "models") == before  # config.json and weights byte for byte


@pytest.mark.parametrize("holding", ["a stage-1 cache", "a model", "someone's files"])
def test_out_holding_what_stage2_did_not_write_is_refused_untouched(
    cache, tmp_path, capsys, holding
):
    out = tmp_path / "out"
    if holding == "a stage-1 cache":
        build_cache(out, teacher_tokenizer="qwen2.5", num_documents=4, docs_per_shard=4)
        expected = f"holds a teacher-loss cache (manifest.json, {shard_name(0)})"
    elif holding == "a model":
        save_tiny_model(out)
        expected = "holds a model (config.json, generation_config.json, model.safetensors)"
    else:  # beside a stage-2 file name, which does not make the folder a run
        out.mkdir()
        (out / "metrics.jsonl").write_text("")
        (out / "notes.txt").write_text("mine")
        expected = "holds files stage 2 did not write (notes.txt)"
    before = snapshot(out)
    capsys.readouterr()
    assert main(train_args(cache, out, *QUICK)) == 2
    message = refusal(capsys)
    assert message.startswith(f"--out {out} {expected}"), message
    assert "not an earlier stage-2 run" in message
    assert snapshot(out) == before


def test_out_a_parent_of_the_cache_is_refused_untouched(tmp_path, capsys):
    data = tmp_path / "data"
    cache = data / "cache"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=4)
    before = snapshot(data)
    capsys.readouterr()
    assert main(train_args(cache, data, *QUICK)) == 2
    assert refusal(capsys).startswith(f"--out {data} and --cache {cache} overlap")
    assert snapshot(data) == before


def test_a_flipped_byte_in_a_shard_is_refused_before_out_exists(tmp_path, capsys):
    cache, out = tmp_path / "cache", tmp_path / "out"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=4)
    shard = cache / shard_name(1)  # without the up-front check, named only once training began
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))  # the same size: only the checksum can tell
    capsys.readouterr()
    assert main(train_args(cache, out, *QUICK)) == 2
    message = refusal(capsys)
    assert message.startswith(f"shard {shard} has sha256 "), message
    assert message.endswith("corrupted or replaced")
    assert not out.exists()  # no folder, no config.json


def test_a_rerun_of_the_same_command_continues_its_own_out(cache, tmp_path, capsys):
    out = tmp_path / "out"
    args = train_args(cache, out, *QUICK)
    assert main([*args, "--stop-at-step", "1"]) == 0
    assert [step for step, _ in complete_checkpoints(out)] == [1]
    capsys.readouterr()
    assert main(args) == 0  # the folder holds config.json, metrics, curves, a checkpoint, the lock
    assert "resuming at step 1" in capsys.readouterr().err
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert (out / "final" / "model.safetensors").exists()
    assert main(args) == 0  # and once more, the schedule already done
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def wait_for(condition, process: subprocess.Popen, log: Path, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(cache, tmp_path, capsys):
    """The first run is a real process, stopped (SIGSTOP) while it holds the lock and trains with
    two data-loader workers, so it cannot finish before the second run asks. Once it is killed,
    its workers (kept alive, stopped) must not keep the lock: the kernel frees it."""
    out, log = tmp_path / "out", tmp_path / "first.log"
    # Too long to finish, never saving on its own: the checkpoint below is the second run's.
    args = train_args(cache, out, "--max-steps", "100000", "--save-every", "100000")
    lock = out / LOCK_NAME
    with log.open("w") as sink:
        first = subprocess.Popen([sys.executable, str(TRAIN), *args], stdout=sink, stderr=sink)

    def holds_lock_and_trained_a_step() -> bool:  # so its data-loader workers are running
        metrics = out / "metrics.jsonl"
        return (
            lock.exists()
            and lock.read_text().startswith(f"pid {first.pid} on ")
            and metrics.exists()
            and metrics.read_text().count("\n") >= 1
        )

    workers: list[psutil.Process] = []
    try:
        wait_for(holds_lock_and_trained_a_step, first, log)
        first.send_signal(signal.SIGSTOP)
        workers = psutil.Process(first.pid).children(recursive=True)
        assert len(workers) == 2
        before = snapshot(out)
        capsys.readouterr()
        assert main([*args, "--stop-at-step", "1"]) == 2
        message = refusal(capsys)
        assert message.startswith(
            f"{out} is being written by another stage-2 run (pid {first.pid} on "
        ), message
        assert snapshot(out) == before  # the second run wrote nothing

        for worker in workers:
            worker.send_signal(signal.SIGSTOP)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
        assert all(worker.is_running() for worker in workers)
        assert main([*args, "--stop-at-step", "1"]) == 0  # the same command goes ahead now
        assert [step for step, _ in complete_checkpoints(out)] == [1]
    finally:
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
        first.kill()  # nothing to do once it has been waited for
        first.wait(timeout=60)
