"""Stage 2 training: exact resume, the final Hugging Face model, refusals with clear messages, and
no teacher anywhere. Runs in-process (single rank) with a tiny Llama student on the real
tinyllama tokenizer; the 2-rank torchrun runs are in test_stage2_torchrun.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.config import from_flat
from pipeline.errors import CacheError, ConfigError
from pipeline.loggers import scalars
from stage2_train.checkpoint import MARKER, check_resumable, complete_checkpoints, resume_from
from stage2_train.config import TrainConfig, parse_train_config
from stage2_train.options import CheckpointingOptions, GuidanceOptions, OptimizerOptions
from stage2_train.schedule import lr_at
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import (
    TRAIN,
    read_metrics,
    record_digests_again,
    tensorboard_scalars,
    train_args,
)
from tests.teacher_audit import assert_no_teacher, audited_env, fake_teacher


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=16, docs_per_shard=8)
    return path


# One micro-batch per step from 2 data-loader workers, so stopping at step 3 leaves the second
# worker next in turn; random selection, so its per-step seeding is replayed too. (The 2-rank
# torchrun test covers token guidance with accumulation and the global selection scope.)
RESUME_ARGS = ("--num-workers", "2", "--global-batch-tokens", "64", "--guidance", "random")


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    assert main(train_args(cache, out, *RESUME_ARGS)) == 0
    return out


def test_stopped_and_resumed_run_matches_the_uninterrupted_one_bit_for_bit(
    cache, uninterrupted, tmp_path
):
    out = tmp_path / "out"
    # Stop at step 3, as a time limit would, then continue the same schedule with --resume auto.
    assert main(train_args(cache, out, *RESUME_ARGS, "--stop-at-step", "3")) == 0
    assert [s for s, _ in complete_checkpoints(out)] == [3]
    assert not (out / "final").exists()  # the schedule is not finished
    assert main(train_args(cache, out, *RESUME_ARGS)) == 0
    assert read_metrics(out) == read_metrics(uninterrupted)  # floats compared exactly
    assert (out / "final" / "model.safetensors").read_bytes() == (
        uninterrupted / "final" / "model.safetensors"
    ).read_bytes()


def test_metrics_and_final_model(uninterrupted, cache):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.cache.manifest import load_manifest
    from pipeline.tokenizer import load_tokenizer
    from stage2_train.data.plan import cache_fingerprint

    records = [
        json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["tokens"] for r in records] == [64 * s for s in range(1, 7)]
    for r in records:
        assert 0.4 <= r["kept_fraction"] < 0.6  # top 40% of mapped + the few unmapped (EOS, BOS)
        assert 0.9 < r["mapped_fraction"] <= 1.0
    assert records[0]["lr"] == pytest.approx(1e-3) and records[-1]["lr"] == pytest.approx(1e-4)
    for r in records:  # rates over the step's target tokens, and over its 64 slots beside them
        targets = 64 * r["tokens_per_second"] / r["slot_tokens_per_second"]
        assert targets == pytest.approx(round(targets)) and 0 < round(targets) <= 64
        assert r["mfu"] is None and r["slot_mfu"] is None  # None on a CPU
    assert any(r["tokens_per_second"] < r["slot_tokens_per_second"] for r in records)  # padding

    final = uninterrupted / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    hf_tokenizer = AutoTokenizer.from_pretrained(final)
    ours = load_tokenizer("tinyllama")
    text = "Question: 12 apples cost $3.50.\nAnswer:"
    assert hf_tokenizer(text)["input_ids"] == ours.encode(text).ids.tolist()  # BOS included
    reloaded = load_tokenizer(str(final)).encode(text, add_eos=True)
    assert reloaded.ids.tolist() == ours.encode(text, add_eos=True).ids.tolist()
    assert reloaded.start.tolist() == ours.encode(text, add_eos=True).start.tolist()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ours.encode(text).ids.tolist()])).logits
    assert logits.shape[-1] == ours.vocab_size
    provenance = json.loads((final / "vocagno.json").read_text())
    assert provenance["cache_fingerprint"] == cache_fingerprint(load_manifest(cache))
    assert provenance["config"]["guidance"] == "random"
    saved = json.loads((uninterrupted / "config.json").read_text())
    assert saved["student"] == "llama-tiny" and saved["world_size"] == 1
    logged = {}  # every number of metrics.jsonl reaches TensorBoard, which keeps float32
    for r in records:
        for tag, value in scalars(r).items():
            logged.setdefault(tag, []).append((r["step"], pytest.approx(value)))
    assert tensorboard_scalars(uninterrupted) == logged


def test_no_save_at_end_saves_only_what_save_every_asks_for(cache, uninterrupted, tmp_path):
    """--no-save-at-end (a benchmark's runs): the same steps, no checkpoint at the last step and
    no final/ (a TinyLlama-sized student's are 17 GB), the checkpoints --save-every asks for kept;
    with --stop-at-step, which saves to resume from, it is refused in one line."""
    out = tmp_path / "out"
    assert main(train_args(cache, out, *RESUME_ARGS, "--no-save-at-end", "--save-every", "4")) == 0
    assert read_metrics(out) == read_metrics(uninterrupted)
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["step-4"]
    assert not (out / "final").exists()
    with pytest.raises(ConfigError, match="--stop-at-step saves a checkpoint to resume from"):
        parse_train_config(train_args(cache, out, "--no-save-at-end", "--stop-at-step", "2"))


def test_guidance_none_keeps_every_token(cache, tmp_path):
    out = tmp_path / "out"
    assert (
        main(train_args(cache, out, "--num-workers", "0", "--guidance", "none", "--max-steps", "2"))
        == 0
    )
    for record in read_metrics(out):
        assert record["kept_fraction"] == 1.0 and record["loss"] == record["loss_all"]


def test_chunk_guidance_runs_and_differs_from_token(cache, tmp_path):
    token, chunk, random = tmp_path / "token", tmp_path / "chunk", tmp_path / "random-chunk"
    common = ("--num-workers", "0", "--max-steps", "2")
    assert main(train_args(cache, token, *common)) == 0
    assert main(train_args(cache, chunk, *common, "--guidance", "chunk", "--num-chunks", "4")) == 0
    assert main(train_args(cache, random, *common, "--guidance", "random-chunk")) == 0
    assert read_metrics(token)[0]["loss_all"] == read_metrics(chunk)[0]["loss_all"]  # same data
    assert read_metrics(token)[0]["loss"] != read_metrics(chunk)[0]["loss"]  # other selection
    assert read_metrics(chunk)[0]["mapped_fraction"] == 1.0  # chunks map every token
    assert read_metrics(random)[0]["loss"] != read_metrics(chunk)[0]["loss"]
    saved = json.loads((random / "config.json").read_text())
    assert saved["guidance"] == "random-chunk" and saved["chunk_student_aggregate"] == "mean"


def test_a_run_from_before_eq3_resumes_only_as_what_it_was(cache, uninterrupted, tmp_path):
    """Runs saved before --loss-normalization divided by the kept count: they continue under
    `kept` and are refused under the new default, never silently switched."""
    old = tmp_path / "old"
    shutil.copytree(uninterrupted, old)
    _, checkpoint = complete_checkpoints(old)[-1]
    saved = json.loads((checkpoint / "config.json").read_text())
    for key in ("loss_normalization", "chunk_student_aggregate"):
        del saved[key]
    (checkpoint / "config.json").write_text(json.dumps(saved))
    meta = json.loads((checkpoint / "checkpoint.json").read_text())
    args = train_args(cache, old, *RESUME_ARGS)
    assert check_resumable(checkpoint, parse_train_config([*args, "--loss-normalization", "kept"]),
                           meta) == 6  # fmt: skip
    with pytest.raises(ConfigError, match='loss_normalization: "kept" -> "all"'):
        check_resumable(checkpoint, parse_train_config(args), meta)


def test_eq3_normalization_is_the_default_and_kept_is_the_option(cache, tmp_path):
    """Paper eq. 3 divides the kept loss by all N target tokens; `kept` by the kept count. On the
    same first step (same init, same data, same selection) the gradients differ by exactly the
    kept fraction, and the choice is in the run's config."""
    runs = {}
    for normalization in ("all", "kept"):
        out = tmp_path / normalization
        args = train_args(cache, out, "--num-workers", "0", "--max-steps", "2")
        if normalization == "kept":
            args += ["--loss-normalization", "kept"]
        assert main(args) == 0
        runs[normalization] = read_metrics(out)[0]
        saved = json.loads((out / "config.json").read_text())
        assert saved["loss_normalization"] == normalization
    assert runs["all"]["kept_fraction"] == runs["kept"]["kept_fraction"] < 0.7
    assert runs["all"]["grad_norm"] / runs["kept"]["grad_norm"] == pytest.approx(
        runs["all"]["kept_fraction"], rel=1e-4
    )


def test_resume_refuses_other_settings_other_cache_and_never(cache, uninterrupted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    with pytest.raises(ConfigError, match=r"topk: 0\.4 -> 0\.5"):
        run(train_args(cache, out, *RESUME_ARGS, "--topk", "0.5"))
    with pytest.raises(ConfigError, match=r"data_consumers: 2 -> 4"):  # another data stream
        run(train_args(cache, out, *RESUME_ARGS, "--data-consumers", "4"))
    saved = out / "checkpoints" / "step-6" / "config.json"
    legacy = {k: v for k, v in json.loads(saved.read_text()).items() if k != "data_consumers"}
    saved.write_text(json.dumps(legacy))  # what a checkpoint from before the option holds
    record_digests_again(saved.parent)
    with pytest.raises(ConfigError, match="is from before --data-consumers: its data positions"):
        run(train_args(cache, out, *RESUME_ARGS))
    other = tmp_path / "other-cache"
    build_cache(other, teacher_tokenizer="qwen2.5", num_documents=16, docs_per_shard=8, seed=1)
    with pytest.raises(CacheError, match="was trained on cache"):
        run(train_args(other, out, *RESUME_ARGS))
    with pytest.raises(ConfigError, match="already has checkpoints up to step 6"):
        run(train_args(cache, out, *RESUME_ARGS, "--resume", "never"))


class _RunsCode:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (Path.touch, (self.canary,))


def test_a_checkpoint_that_would_run_code_is_refused_unloaded(cache, uninterrupted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(out / "final")
    canary = tmp_path / "code-ran"
    torch.save({"rng": _RunsCode(canary)}, out / "checkpoints" / "step-6" / "rank-0.pt")
    record_digests_again(out / "checkpoints" / "step-6")  # crafted with its marker
    with pytest.raises(CacheError, match="rank-0.pt holds objects other than tensors"):
        run(train_args(cache, out, *RESUME_ARGS))
    assert not canary.exists()


def run(argv: list[str]) -> None:
    """Train in-process, letting errors propagate (main() turns them into exit code 2)."""
    from stage2_train.trainer import train

    train(parse_train_config(argv))


def test_errors_are_one_line_and_exit_2(cache, tmp_path, capsys):
    assert main(train_args(tmp_path / "nowhere", tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stage2_train/train.py: error: cache folder") and "\n" not in err
    assert main(train_args(cache, tmp_path / "out", "--global-batch-tokens", "96")) == 2
    assert "must be a multiple of --micro-batch-size x --seq-len (64)" in capsys.readouterr().err
    assert (
        main(
            [
                *train_args(cache, tmp_path / "out")[:2],
                "--student",
                "llama-tiny",
                "--out",
                str(tmp_path / "o"),
                "--max-steps",
                "3",
                "--warmup-steps",
                "1",
            ]
        )
        == 2
    )
    assert "pass --student-tokenizer" in capsys.readouterr().err


def test_training_never_imports_a_teacher_nor_opens_its_files(tmp_path):
    """A real `python stage2_train/train.py` process, audited (tests/teacher_audit.py); the
    2-rank torchrun version is in test_stage2_torchrun.py."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    build_cache(
        cache, num_documents=4, docs_per_shard=4, teacher=fake_teacher(tmp_path / "teacher")
    )
    command = [
        sys.executable,
        str(TRAIN),
        *train_args(cache, out, "--num-workers", "0", "--stop-at-step", "1"),
    ]
    result = subprocess.run(
        command,
        env={**os.environ, **audited_env(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_no_teacher(tmp_path, tmp_path / "teacher", out, ranks=1)


def test_incomplete_checkpoints_are_never_resumed(tmp_path):
    config = CheckpointingOptions(out=tmp_path)
    for step, complete in ((2, True), (4, True), (6, False)):
        folder = tmp_path / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        if complete:
            (folder / MARKER).write_text("")
    (tmp_path / "checkpoints" / ".step-8.partial").mkdir()  # a crash mid-save
    assert resume_from(config) == tmp_path / "checkpoints" / "step-4"
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        resume_from(replace(config, resume=str(tmp_path / "checkpoints" / "step-6")))


def test_schedule_warms_up_then_decays_to_min_lr():
    config = OptimizerOptions(max_steps=11, warmup_steps=2, lr=1.0, min_lr=0.1)
    assert [lr_at(s, config) for s in (1, 2)] == [0.5, 1.0]
    assert lr_at(3, config) == pytest.approx(1.0) and lr_at(11, config) == pytest.approx(0.1)
    decay = [lr_at(s, config) for s in range(3, 12)]
    assert decay == sorted(decay, reverse=True)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"topk": 0.0}, "topk"),
        ({"warmup_steps": 10}, "--warmup-steps"),
        ({"stop_at_step": 11}, "--stop-at-step"),
        ({"min_lr": 1.0}, "--min-lr"),
        ({"seq_len": 0}, "--seq-len"),
        ({"guidance": "soft"}, "guidance"),
        ({"guidance": "chunk", "loss_normalization": "kept"}, "loss-normalization kept"),
        ({"chunk_student_aggregate": "median"}, "chunk student"),
    ],
)
def test_config_validation(change, message):
    base = {"cache": "c", "student": "s", "out": "o", "max_steps": 10, "warmup_steps": 1}
    with pytest.raises(ValueError, match=message):
        from_flat(TrainConfig, {**base, **change})


def test_accumulation_must_divide_the_global_batch_by_world_size():
    config = from_flat(TrainConfig, dict(
        cache=Path("c"), student="s", out=Path("o"), max_steps=10, warmup_steps=1, seq_len=32,
        micro_batch_size=2, global_batch_tokens=192,
    ))  # fmt: skip
    assert config.accumulation_steps(1) == 3
    with pytest.raises(ConfigError, match="world size x --micro-batch-size x --seq-len"):
        config.accumulation_steps(2)


def test_the_example_manifest_is_a_valid_stage2_job():
    manifest = Path(__file__).resolve().parents[1] / "manifests" / "stage2-example.toml"
    config = parse_train_config(["--manifest", str(manifest)])
    assert config.guidance.mode == "token" and config.model.student_tokenizer == "tinyllama"
    assert [config.accumulation_steps(n) for n in (1, 2)] == [8, 4]


def test_continual_pretraining_starts_from_a_local_hf_folder(cache, uninterrupted, tmp_path):
    """A trained student folder (weights + tokenizer) as --student: its own tokenizer is used and
    the first step's loss is exactly what those weights give on the first batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.cross_entropy import IGNORE_INDEX, token_loss
    from stage2_train.attention import student_logits
    from stage2_train.data.plan import DataPlan
    from stage2_train.data.streams import consumer_stream

    folder, out = uninterrupted / "final", tmp_path / "out"
    args = train_args(cache, out, "--num-workers", "0", "--global-batch-tokens", "64")
    args[args.index("--student") + 1] = str(folder)
    del args[args.index("--student-tokenizer") : args.index("--student-tokenizer") + 2]
    assert main([*args, "--guidance", "none", "--max-steps", "2"]) == 0
    plan = DataPlan.from_cache(cache, student_tokenizer=str(folder), seq_len=32, micro_batch_size=2)
    batch = next(iter(consumer_stream(plan, 0)))  # the default, documents packing
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        losses = token_loss(student_logits(model, batch, torch.device("cpu")), batch["labels"])
        expected = losses[batch["labels"] != IGNORE_INDEX].double().mean()
    assert read_metrics(out)[0]["loss_all"] == pytest.approx(float(expected), rel=1e-5)


def test_a_config_json_student_is_trained_from_scratch(cache, tmp_path):
    config = tmp_path / "student.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 32000,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
            }
        )
    )
    out = tmp_path / "out"
    args = train_args(cache, out, "--num-workers", "0", "--max-steps", "2")
    args[args.index("--student") + 1] = str(config)
    assert main(args) == 0
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved["hidden_size"] == 32 and saved["num_hidden_layers"] == 1


def test_accumulation_gives_the_same_step_as_one_big_micro_batch(cache, tmp_path):
    """Two micro-batches of 2 sequences and one of 4 of one consumer's stream hold the same windows
    in the same order; the loss is a mean over the step's tokens either way, so training follows
    the same trajectory."""
    runs = {}
    for micro in (2, 4):
        out = tmp_path / f"micro-{micro}"
        args = train_args(cache, out, "--data-consumers", "1", "--num-workers", "0")
        args += ["--micro-batch-size", str(micro)]
        assert main([*args, "--guidance", "none", "--max-steps", "3"]) == 0
        runs[micro] = read_metrics(out)
    for a, b in zip(runs[2], runs[4], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_student_specs_and_device_options_are_checked(cache, tmp_path, capsys):
    import torch

    from pipeline.models.student import student_kind
    from stage2_train.distributed import Runtime
    from stage2_train.resolve import resolve_dtype

    assert student_kind("llama-tiny") == "preset"
    assert student_kind("TinyLlama/TinyLlama_v1.1") == "pretrained"  # a hub id
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        student_kind(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="is not a preset"):
        student_kind("./no-such-student")
    # A typo of a preset is refused at once, naming the presets (not tried on the hub).
    with pytest.raises(
        ConfigError, match=r"'llama-huge' is not a preset \(llama-tiny, llama-small"
    ):
        student_kind("llama-huge")
    cpu = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="bfloat16 needs a GPU"):
        resolve_dtype("bfloat16", cpu.device)
    assert main(train_args(cache, tmp_path / "out", "--fsdp")) == 2
    assert "--fsdp shards the student across ranks" in capsys.readouterr().err


def test_resume_under_another_thread_count_warns_that_it_is_not_bit_identical(
    cache, uninterrupted, tmp_path
):
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with pytest.warns(UserWarning, match=f"written with {threads} torch threads"):
            run(train_args(cache, out, *RESUME_ARGS))
    finally:
        torch.set_num_threads(threads)


def test_option_choices_are_the_declared_ones():
    """The Literal of each guidance option is the declaration in pipeline.guidance, once."""
    import typing

    from pipeline.guidance import CHUNK_STUDENT_AGGREGATES, GUIDANCE_MODES, LOSS_NORMALIZATIONS

    hints = typing.get_type_hints(GuidanceOptions)
    assert typing.get_args(hints["mode"]) == GUIDANCE_MODES
    assert typing.get_args(hints["loss_normalization"]) == LOSS_NORMALIZATIONS
    assert typing.get_args(hints["chunk_student_aggregate"]) == CHUNK_STUDENT_AGGREGATES


def test_flex_training_on_a_cpu_stops_in_one_line_before_writing(cache, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(cache, out, "--attention", "flex")) == 2
    assert capsys.readouterr().err.strip().endswith("use --attention dense, or auto")
    assert not out.exists()


def test_fsdp_parameters_follow_the_compute_dtype_and_bfloat16_ones_need_fsdp(
    cache, tmp_path, capsys
):
    """--fsdp-param-dtype auto: bfloat16 where FSDP computes in bfloat16 (a GPU with --dtype auto
    or bfloat16), float32 elsewhere; bfloat16 without --fsdp is refused in one line. (Training
    with it: test_stage2_torchrun.py.)"""
    from stage2_train.resolve import resolve_fsdp_param_dtype

    def resolved(*extra: str, device: str) -> str:
        config = parse_train_config(train_args(cache, tmp_path / "unused", *extra))
        return resolve_fsdp_param_dtype(config.model, torch.device(device))

    assert resolved("--fsdp", device="cuda") == "bfloat16"
    assert resolved("--fsdp", "--dtype", "float32", device="cuda") == "float32"
    assert resolved("--fsdp", device="cpu") == "float32"
    assert resolved("--fsdp", "--fsdp-param-dtype", "bfloat16", device="cpu") == "bfloat16"
    assert resolved(device="cuda") == "float32"  # no --fsdp: the parameters as they are
    out = tmp_path / "run"
    assert main(train_args(cache, out, "--fsdp-param-dtype", "bfloat16")) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--fsdp-param-dtype bfloat16 applies to --fsdp; add --fsdp or drop it"
    )
    assert not out.exists()


def test_the_resolved_attention_is_saved_and_a_resume_must_match_it(
    cache, uninterrupted, tmp_path, capsys
):
    saved = json.loads((uninterrupted / "config.json").read_text())
    assert (saved["attention"], saved["resolved_attention"]) == ("auto", "dense")
    assert (saved["adamw_kernel"], saved["resolved_adamw_kernel"]) == ("auto", "plain")
    assert (saved["compile"], saved["resolved_compile"]) == ("auto", "off")
    assert (saved["loss_kernel"], saved["resolved_loss_kernel"]) == ("auto", "plain")
    assert (saved["fsdp_param_dtype"], saved["resolved_fsdp_param_dtype"]) == ("auto", "float32")
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    checkpoint = out / "checkpoints" / "step-6" / "checkpoint.json"
    record = json.loads(checkpoint.read_text())
    assert record["resolved_attention"] == "dense"
    checkpoint.write_text(json.dumps({**record, "resolved_attention": "flex"}))
    record_digests_again(checkpoint.parent)  # as a run with --attention flex would have saved
    assert main(train_args(cache, out, *RESUME_ARGS, "--attention", "dense")) == 2
    assert (
        "was trained with --attention flex, this run would use dense: resume with "
        "--attention flex" in capsys.readouterr().err
    )


def test_the_fused_adamw_kernel_trains_what_the_plain_one_does(cache, uninterrupted, tmp_path):
    """--adamw-kernel fused (auto's choice on a GPU) on the CPU: the same per-step losses as the
    plain run within float rounding, the optimizer really is torch's fused one, and a fused run
    stopped at step 3 and resumed equals its uninterrupted self exactly."""
    from pipeline.models.student import build_student
    from pipeline.tokenizer import load_tokenizer
    from stage2_train.schedule import make_optimizer

    config = parse_train_config(train_args(cache, tmp_path / "unused"))
    model = build_student("llama-tiny", load_tokenizer("tinyllama"), 0, 32)
    assert make_optimizer(model, config.optimizer, "fused").defaults["fused"] is True
    assert not make_optimizer(model, config.optimizer, "plain").defaults["fused"]
    out = tmp_path / "fused"
    assert main(train_args(cache, out, *RESUME_ARGS, "--adamw-kernel", "fused")) == 0
    fused, plain = read_metrics(out), read_metrics(uninterrupted)
    assert [r["step"] for r in fused] == [r["step"] for r in plain]
    for ours, theirs in zip(fused, plain, strict=True):
        for key in ("loss", "loss_all", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (key, ours, theirs)
    assert_resumes_bit_for_bit(cache, tmp_path / "resumed", fused, "--adamw-kernel", "fused")


def assert_resumes_bit_for_bit(cache: Path, out: Path, whole: list[dict], *switch: str) -> None:
    """A run with `switch` stopped at step 3 and resumed logs `whole`, its uninterrupted
    metrics, exactly."""
    command = train_args(cache, out, *RESUME_ARGS, *switch)
    assert main([*command, "--stop-at-step", "3"]) == 0
    assert main(command) == 0
    assert read_metrics(out) == whole


def test_activation_checkpointing_trains_the_same_bits_and_may_change_on_resume(
    cache, uninterrupted, tmp_path
):
    """--activation-checkpointing recomputes each decoder layer in the backward pass: the same
    kernels on the same inputs, so on a CPU the run is the plain one exactly (tolerance 0; see
    tests/test_stage2_activation_checkpointing.py). It changes only memory and time, so a run
    stopped with it continues without it, and the continuation is still the plain run."""
    checkpointed, resumed = tmp_path / "checkpointed", tmp_path / "resumed"
    assert main(train_args(cache, checkpointed, *RESUME_ARGS, "--activation-checkpointing")) == 0
    assert json.loads((checkpointed / "config.json").read_text())["activation_checkpointing"]
    assert read_metrics(checkpointed) == read_metrics(uninterrupted)
    assert (checkpointed / "final" / "model.safetensors").read_bytes() == (
        uninterrupted / "final" / "model.safetensors"
    ).read_bytes()
    stopped = ("--activation-checkpointing", "--stop-at-step", "3")
    assert main(train_args(cache, resumed, *RESUME_ARGS, *stopped)) == 0
    assert main(train_args(cache, resumed, *RESUME_ARGS)) == 0
    assert read_metrics(resumed) == read_metrics(uninterrupted)


def test_a_compiled_run_trains_what_eager_does_and_resumes_bit_for_bit(
    cache, uninterrupted, tmp_path
):
    """--compile layers (auto's choice on a GPU) on the CPU: per-step losses as the eager run's
    within float reassociation, and stopped at step 3 and resumed it equals its uninterrupted
    self exactly (each process compiles the same kernels)."""
    from torch._dynamo.utils import counters

    compiled, resumed = tmp_path / "compiled", tmp_path / "resumed"
    started, frames = time.monotonic(), counters["frames"]["ok"]
    assert main(train_args(cache, compiled, *RESUME_ARGS, "--compile", "layers")) == 0
    print(f"compiled run, compiling included: {time.monotonic() - started:.1f} s")
    assert counters["frames"]["ok"] > frames  # dynamo compiled the layers, not ran them eagerly
    assert json.loads((compiled / "config.json").read_text())["resolved_compile"] == "layers"
    for ours, theirs in zip(read_metrics(compiled), read_metrics(uninterrupted), strict=True):
        for key in ("loss", "loss_all", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4), (key, ours, theirs)
    assert_resumes_bit_for_bit(cache, resumed, read_metrics(compiled), "--compile", "layers")


def test_the_chunked_loss_trains_what_the_full_logits_do(cache, uninterrupted, tmp_path, capsys):
    """--loss-kernel chunked (auto's choice on a GPU) on the CPU: the run's per-step losses and
    gradient norms as the plain run's, within float32 rounding, and stopped at step 3 and resumed
    its own exactly; where it cannot apply (a student whose logits are not a bare linear head's)
    it is refused in one line. (The distillation terms' chunked runs:
    test_stage2_distillation.py, test_stage2_alm.py; under --fsdp: test_stage2_torchrun.py.)"""
    out = tmp_path / "chunked"
    assert main(train_args(cache, out, *RESUME_ARGS, "--loss-kernel", "chunked")) == 0
    assert json.loads((out / "config.json").read_text())["resolved_loss_kernel"] == "chunked"
    for ours, theirs in zip(read_metrics(out), read_metrics(uninterrupted), strict=True):
        for key in ("loss", "loss_all", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (key, ours, theirs)
    chunked = ("--loss-kernel", "chunked")
    assert_resumes_bit_for_bit(cache, tmp_path / "resumed", read_metrics(out), *chunked)
    capsys.readouterr()
    refused, gpt2 = tmp_path / "refused", tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 32000, "n_embd": 32,
                                "n_layer": 1, "n_head": 2}))  # fmt: skip
    args = train_args(cache, refused, "--loss-kernel", "chunked")
    args[args.index("--student") + 1] = str(gpt2)
    assert main(args) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--loss-kernel chunked: a 'gpt2' student's logits are not known to be a bias-free linear "
        "head's product (supported: llama, mistral, qwen2, qwen3); use --loss-kernel plain"
    )
    assert not refused.exists()


def test_a_run_whose_gradients_turn_non_finite_stops_keeping_its_last_good_checkpoint(
    cache, tmp_path, capsys
):
    """A learning rate of 1e30 makes step 2's gradient norm NaN. Before: the run trained on and
    wrote a final/ of NaN tensors, exit 0. It stops at that step, in one line naming it, before
    saving it: the step-1 checkpoint is the last, and no final/ is written."""
    out = tmp_path / "out"
    args = train_args(cache, out, "--lr", "1e30", "--min-lr", "1e29", "--save-every", "1",
                      "--num-workers", "0")  # fmt: skip
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "step 2's loss" in err[0] and "is not finite" in err[0], err
    assert "its checkpoints up to step 1 are kept and no final/ is written" in err[0]
    assert [step for step, _ in complete_checkpoints(out)] == [1]
    assert not (out / "final").exists()
    assert [record["step"] for record in read_metrics(out)] == [1]
