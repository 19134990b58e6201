"""Stage 2's checks before any work: each refuses in one line what would otherwise fail late,
hang, be killed without a word, or train on something other than what was asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.cache.schema import shard_name
from pipeline.errors import CacheError, ConfigError
from stage2_train import preflight
from stage2_train.config import parse_train_config
from stage2_train.train import main
from stage2_train.trainer import train
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args


@pytest.fixture()
def cache(tmp_path) -> Path:
    path = tmp_path / "cache"
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=4)
    return path


def run(argv: list[str]) -> None:
    train(parse_train_config(argv))


def test_out_inside_or_equal_to_the_cache_is_refused(cache, capsys):
    assert main(train_args(cache, cache)) == 2
    err = capsys.readouterr().err
    assert "overlap: checkpoints and the model would be written into the cache" in err
    with pytest.raises(ConfigError, match="overlap"):
        run(train_args(cache, cache / "run"))
    assert sorted(p.name for p in cache.iterdir()) == [
        "manifest.json", shard_name(0), shard_name(1)
    ]  # fmt: skip


def test_a_deleted_shard_is_refused_before_the_first_step(cache, tmp_path):
    (cache / shard_name(1)).unlink()
    with pytest.raises(CacheError, match=rf"1 of 2 shard\(s\) .*{shard_name(1)} is missing"):
        run(train_args(cache, tmp_path / "out"))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # no compute was spent


def test_a_sequence_beyond_the_students_positions_is_refused(cache, tmp_path):
    student = tmp_path / "student.json"
    student.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "vocab_size": 32000,
    }))  # fmt: skip
    argv = train_args(
        cache, tmp_path / "out", "--student", str(student), "--seq-len", "128",
        "--global-batch-tokens", "256",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--seq-len 128 is beyond the student's 64 positions"):
        run(argv)


def test_a_micro_batch_that_cannot_fit_in_memory_is_refused(cache, tmp_path, monkeypatch):
    # 32 x 32 tokens of a 32,000-token vocabulary: about 0.4 GiB of logits; give it a quarter.
    monkeypatch.setattr(preflight, "available_memory", lambda device: 2**27)
    argv = train_args(
        cache, tmp_path / "out", "--micro-batch-size", "32", "--global-batch-tokens", "1024"
    )
    with pytest.raises(ConfigError) as refusal:
        run(argv)
    message = str(refusal.value)
    assert message.startswith(
        "a training step needs about 447 MiB per rank (64 MiB of float32 weights"
    )
    assert "of activations, for a micro-batch of 32 x 32 tokens on 1 rank(s)" in message
    assert "lower --micro-batch-size" in message and "with --fsdp" in message
    assert "add --activation-checkpointing" in message


def test_a_student_whose_state_alone_cannot_fit_is_refused(cache, tmp_path, monkeypatch):
    """The model counts, not only the activations: llama-tiny's 4.2M parameters need 16 bytes
    each (float32 weights, gradients, AdamW's two moments), more than the memory given it."""
    from pipeline.models.student import build_student
    from pipeline.tokenizer import load_tokenizer

    student = build_student("llama-tiny", load_tokenizer("tinyllama"), 0, 32)
    parameters = sum(p.numel() for p in student.parameters())
    monkeypatch.setattr(preflight, "available_memory", lambda device: 16 * parameters - 1)
    argv = train_args(cache, tmp_path / "out", "--micro-batch-size", "1",
                      "--global-batch-tokens", "64")  # fmt: skip
    with pytest.raises(ConfigError, match=r"\(64 MiB of float32 weights, gradients and AdamW "
                       r"moments, 12 MiB of activations.*: shard the model's state with --fsdp"):  # fmt: skip
        run(argv)
    assert not (tmp_path / "out").exists()


def test_a_step_larger_than_the_whole_cache_is_refused(cache, tmp_path):
    argv = train_args(cache, tmp_path / "out", "--global-batch-tokens", str(2**20))
    with pytest.raises(ConfigError, match="is more than the whole cache"):
        run(argv)


def test_a_fresh_start_in_a_failed_runs_folder_drops_its_curves(cache, tmp_path):
    out = tmp_path / "out"
    stale = out / "tensorboard" / "events.out.tfevents.0.failed-run"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old curves")
    run(train_args(cache, out, "--max-steps", "2"))
    assert not stale.exists() and any((out / "tensorboard").iterdir())


def test_a_scratch_folder_too_long_for_the_workers_sockets_is_refused(monkeypatch, tmp_path):
    """Data-loader workers hand batches over through Unix sockets in TMPDIR; too long a path
    would leave the first step waiting forever (found with a deep node-local scratch)."""
    import socket
    import tempfile

    longest = preflight.SOCKET_PATH_BYTES - preflight.SOCKET_SUFFIX_BYTES
    root = Path(tempfile.mkdtemp(prefix="s-"))
    try:
        for extra, fits in ((0, True), (1, False)):
            scratch = root / ("d" * (longest + extra - len(str(root)) - 1))
            monkeypatch.setattr(tempfile, "tempdir", str(scratch))
            # the socket a worker would open there binds exactly when the check lets it through
            (scratch / "pymp-XXXXXXXX").mkdir(parents=True)
            with socket.socket(socket.AF_UNIX) as sock:
                try:
                    sock.bind(str(scratch / "pymp-XXXXXXXX" / "listener-XXXXXXXX"))
                    bound = True
                except OSError:
                    bound = False
            assert bound == fits
            if fits:
                preflight.check_scratch(workers=2)
            else:
                with pytest.raises(ConfigError, match=f"TMPDIR {scratch} is longer than 75 bytes"):
                    preflight.check_scratch(workers=2)
            preflight.check_scratch(workers=0)  # no workers, no sockets
    finally:
        shutil.rmtree(root)
