"""What stage 2 will run, before it runs (issue 78, item 3): `--print-config` prints every option
with where its value came from (default, manifest, flag) as a manifest that gives the same
config back; `--dry-run` adds each `auto` switch as resolved and the plan (world size, steps,
accumulation, epochs of the cache, memory), and neither writes anything or starts a process
group. The Table 1 manifest plans for one 8-GPU node here, on assumed H100s."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch.distributed as dist

from pipeline.config import parse_config, sections_of
from stage2_train.config import SECTION, TrainConfig, parse_train_config
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args

REPO = Path(__file__).resolve().parents[1]
TABLE1 = REPO / "manifests" / "paper" / "table1-qwen2.5-math-7b-instruct.toml"
# One node of 8 H100s; the student's config and tokenizer are on the hub, out of reach offline:
# the paper's student architecture (a preset) with TinyLlama's tokenizer stands in for them.
ONE_NODE = ["--dry-run", "--assume-world-size", "8", "--assume-device", "h100",
            "--assume-student", "tinyllama-1.1b", "--assume-student-tokenizer", "tinyllama"]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=4)
    return path


def files_under(*folders: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for f in folders for p in f.rglob("*")}


def option_line(stdout: str, key: str) -> tuple[str, str]:
    """(value, source) of `key = value  # source` in a listing."""
    found = re.search(rf"^{key} = (.+?)\s+# (\w+)$", stdout, re.MULTILINE)
    assert found, f"{key} not listed:\n{stdout}"
    return found[1], found[2]


def test_the_dry_run_says_where_each_option_came_from_and_writes_nothing(cache, tmp_path, capsys):
    out = tmp_path / "out"
    argv = train_args(cache, out, "--num-workers", "0")
    manifest = tmp_path / "run.toml"
    manifest.write_text("[stage2]\ntopk = 0.3\nlr = 0.002\n[stage2.optimizer]\nmax_steps = 9\n")
    before = files_under(tmp_path, cache)

    assert main(["--manifest", str(manifest), *argv, "--dry-run"]) == 0
    stdout = capsys.readouterr().out

    assert option_line(stdout, "topk") == ("0.3", "manifest")
    assert option_line(stdout, "lr") == ("0.001", "flag")  # train_args' --lr 1e-3 wins
    assert option_line(stdout, "max_steps") == ("6", "flag")
    assert option_line(stdout, "seed") == ("0", "default")
    assert option_line(stdout, "student") == ('"llama-tiny"', "flag")
    assert option_line(stdout, "student_tokenizer") == ('"tinyllama"', "flag")
    # every option, in --help's order of sections
    tables = re.findall(r"^\[(.+)\]$", stdout, re.MULTILINE)
    assert tables == [f"stage2.{section}" for section in sections_of(TrainConfig)]
    # the plan, as this CPU resolves it
    assert "device: this machine's CPU" in stdout
    assert "world size: 1 (one process)" in stdout
    assert "attention auto -> dense" in stdout and "compile auto -> off" in stdout
    assert "steps: 6 (warmup 1) of 128 tokens: 768 tokens" in stdout
    assert "accumulation: 2 micro-batches of 2 x 32 tokens per rank and step on 1 rank" in stdout
    assert re.search(r"each world size .*: 1: 2, 2: 1$", stdout, re.MULTILINE)
    assert re.search(r"^epochs of the cache: the schedule reads 768 tokens, about [\d.]+ epochs",
                     stdout, re.MULTILINE)  # fmt: skip
    assert re.search(r"^memory per rank: about .* of .*: fits$", stdout, re.MULTILINE)

    assert not out.exists()
    assert files_under(tmp_path, cache) == before  # nothing written, the cache untouched
    assert not dist.is_initialized()


def test_print_config_is_a_manifest_that_gives_the_same_config(cache, tmp_path, capsys):
    argv = train_args(cache, tmp_path / "out", "--guidance", "uld", "--more-caches",
                      str(tmp_path / "b"), "--teacher-weights", "1", "2.5")  # fmt: skip
    assert main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "# the plan" not in printed  # the options only
    tomllib.loads(printed)  # valid TOML, unset options as comments
    manifest = tmp_path / "printed.toml"
    manifest.write_text(printed)
    again = parse_config(TrainConfig, ["--manifest", str(manifest)], "", SECTION)
    assert again.fingerprint == parse_train_config(argv).fingerprint
    assert not (tmp_path / "out").exists()


def test_the_table1_manifest_plans_one_8_gpu_node_with_16_accumulation_steps(capsys):
    assert main(["--manifest", str(TABLE1), *ONE_NODE]) == 0
    stdout = capsys.readouterr().out
    assert option_line(stdout, "micro_batch_size") == ("8", "manifest")
    assert re.search(r"^# student_tokenizer unset\s+# default$", stdout, re.MULTILINE)  # no null
    assert (
        "device: assumed (--assume-device h100): NVIDIA H100 80GB HBM3, 81,559 MiB (all of it"
        in stdout
    )
    assert "world size: 8 (assumed: --assume-world-size)" in stdout
    assert "loss_kernel auto -> chunked" in stdout and "attention auto -> flex" in stdout
    assert "accumulation: 16 micro-batches of 8 x 2,048 tokens per rank and step on 8" in stdout
    assert "8: 16, 16: 8, 32: 4" in stdout  # the paper's 4 nodes: 4 (docs/stage2.md)
    assert "epochs of the cache: unknown: cache not found here" in stdout
    assert re.search(r"^memory per rank: about [\d.]+ GiB .* of 79.6 GiB: fits$", stdout,
                     re.MULTILINE)  # fmt: skip


def test_a_world_size_the_batch_does_not_split_is_refused_after_the_options(
    cache, tmp_path, capsys
):
    argv = train_args(cache, tmp_path / "out", "--dry-run", "--assume-world-size", "3")
    assert main(argv) == 2
    said = capsys.readouterr()
    assert "# stage 2 --dry-run" in said.out
    assert "--global-batch-tokens (128) must be a multiple of world size" in said.err


def test_an_assumption_without_the_dry_run_is_refused(cache, tmp_path, capsys):
    assert main(train_args(cache, tmp_path / "out", "--assume-world-size", "8")) == 2
    err = capsys.readouterr().err.strip()
    assert "--assume-world-size is an assumption of --dry-run" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_under_torchrun_rank_0_plans_for_its_world_size_and_the_others_print_nothing(
    cache, tmp_path, capsys, monkeypatch
):
    argv = train_args(cache, tmp_path / "out", "--num-workers", "0", "--dry-run")
    torchrun = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}  # fmt: skip
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "world size: 2 (torchrun's WORLD_SIZE)" in stdout
    assert "accumulation: 1 micro-batches of 2 x 32 tokens per rank and step on 2" in stdout
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(argv) == 0
    assert capsys.readouterr().out == ""
    assert not dist.is_initialized() and not (tmp_path / "out").exists()


def test_the_table1_manifest_on_this_cpu_is_refused_as_its_run_would_be(capsys):
    """Its --dtype bfloat16 needs a GPU: the dry run says so, and how to plan for one."""
    argv = ["--manifest", str(TABLE1), *ONE_NODE]
    assert main([arg for arg in argv if arg not in ("--assume-device", "h100")]) == 2
    err = capsys.readouterr().err
    assert "--dtype bfloat16 needs a GPU" in err and "--assume-device plans for a GPU" in err
