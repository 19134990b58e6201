"""The dose-response's steps: the teacher and one stage-1 cache (loss, top-k and space columns),
then for each warm-start length a plainly trained warm start (its held-out loss recorded as it
goes), the selection diagnostic on the cache, and every arm trained from it for the same budget
and evaluated; then the report. A rerun reuses every finished step: the cache, each warm start,
each diagnostic, each arm's final model and each evaluation."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

from apps.demo.arms import ArmRun, selection_diagnostic, selection_done, train_arm
from apps.demo.run import (
    StepTimings,
    check_stage_tables,
    eval_path,
    evaluate_models,
    make_warm_start,
    score_train_docs,
    teacher_folder,
    warm_start_done,
    write_corpus_slice,
)
from experiments.dose.config import DoseConfig
from experiments.dose.report import (
    arm_name,
    earlier_points,
    heldout_path,
    rung_folder,
    write_dose_report,
)
from pipeline.errors import ConfigError
from pipeline.io import atomic_write_json
from pipeline.log import get_logger
from stage2_train.config import TrainConfig

log = get_logger("dose").info


def rung_config(config: DoseConfig, steps: int) -> DoseConfig:
    """The demo's options for one warm-start length: its own folder for the warm start, the
    arms and their evaluations (the cache stays in the experiment's folder)."""
    return dataclasses.replace(config, out=rung_folder(config.out, steps), warm_start_steps=steps)


def train_and_evaluate(
    rung: DoseConfig, stage2: TrainConfig, settings: dict, manifest: Path, cache: Path,
    student: Path, arm: str, seed: int, lr: float | None, heldout: list[str],
) -> None:  # fmt: skip
    """One arm from the rung's warm start for the whole budget (at peak rate `lr`, the [stage2]
    schedule scaled to it; None: the [stage2] rate), then its evaluation and, in a sweep, its
    held-out loss; its checkpoints are removed once the final model is written (disk)."""
    from apps.demo.warm_start import heldout_loss

    name = arm_name(arm, seed, lr)
    min_lr = None if lr is None else lr * stage2.optimizer.min_lr / stage2.optimizer.lr
    run = ArmRun(name, arm, seed=seed, lr=lr, min_lr=min_lr)
    out = train_arm(rung, manifest, cache, student, run)
    evaluate_models(rung, settings, {name: out / "final"})
    if lr is not None and not heldout_path(rung.out, name).exists():
        batch = stage2.optimizer.global_batch_tokens // stage2.data.seq_len
        loss = heldout_loss(out / "final", heldout, stage2.data.seq_len, batch)
        atomic_write_json(heldout_path(rung.out, name), {"heldout_loss": loss})


class CallTime:
    """`stop_after_seconds`: whether this call has time for one more step."""

    def __init__(self, config: DoseConfig, steps: StepTimings):
        self.limit, self.steps, self.began = config.stop_after_seconds, steps, time.monotonic()

    def over(self, step: str, arm: bool) -> bool:
        """True (and said) where `step` should wait for the next call: the limit has passed, or
        an arm would end past it by the longest arm's time so far (this call's or a past one's)."""
        if not self.limit:
            return False
        elapsed = time.monotonic() - self.began
        arms = [s for name, s in self.steps.seconds.items() if arm and re.match(r"\d+-", name)]
        if elapsed + max(arms, default=0.0) < self.limit:
            return False
        log(f"stopped before {step}, {elapsed:.0f} s into this call (stop_after_seconds "
            f"{self.limit:g}): run the same command again to continue")  # fmt: skip
        return True


def run_dose(config: DoseConfig, manifest: Path) -> Path | None:
    """OUT/report.md, or None where `stop_after_seconds` stopped this call first."""
    stage2, settings, prereg = check_stage_tables(config, manifest)
    earlier_points(config)  # read by the report, last: a bad file is refused before the first step
    config.out.mkdir(parents=True, exist_ok=True)
    steps = StepTimings(config.out)
    call = CallTime(config, steps)
    if config.cache:
        cache = Path(config.cache)  # made elsewhere: no teacher is needed here
        if not (cache / "manifest.json").is_file():
            raise ConfigError(
                f"cache {cache} has no manifest.json: make it first (the CPU design, "
                "manifests/dose-response.toml, scores it) or give a finished stage-1 cache"
            )
        log(f"training from the cache at {cache}")
    else:
        cache = score_train_docs(config, manifest, teacher_folder(config, steps), steps)
    heldout_file = write_corpus_slice(
        config.out / "corpus" / "heldout.jsonl", config.heldout_docs, config.heldout_offset
    )
    heldout = [json.loads(line)["text"] for line in heldout_file.read_text().splitlines()]
    for length in config.warm_start_ladder:
        rung = rung_config(config, length)
        if not warm_start_done(rung) and call.over(f"the warm start of {length} steps", False):
            return None
        log(f"warm start of {length} steps")
        student = steps.timed(
            f"warm-start-{length}", warm_start_done(rung), make_warm_start, rung, stage2,
            heldout, config.heldout_every,
        )  # fmt: skip
        steps.timed(
            f"selection-{length}", selection_done(rung), selection_diagnostic, rung, stage2,
            cache, student,
        )  # fmt: skip
        steps.timed(
            f"eval-warm-start-{length}", eval_path(rung, "warm-start").exists(), evaluate_models,
            rung, settings, {"warm-start": student},
        )  # fmt: skip
        runs = [
            (seed, arm, lr)
            for seed in config.seeds_at(length)
            for arm in config.arms
            for lr in config.arm_lrs or [None]
        ]
        for seed, arm, lr in runs:
            name = arm_name(arm, seed, lr)
            swept = lr is None or heldout_path(rung.out, name).exists()
            if eval_path(rung, name).exists() and swept:
                continue
            if call.over(f"warm start {length}'s {name}", True):
                return None
            log(f"warm start {length}: {name}, stage 2 for {stage2.optimizer.max_steps} steps, "
                "evaluate")
            steps.timed(
                f"{length}-{name}", False, train_and_evaluate, rung, stage2, settings, manifest,
                cache, student, arm, seed, lr, heldout,
            )  # fmt: skip
    return write_dose_report(config, manifest, prereg, steps.seconds)
