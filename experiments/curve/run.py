"""The guidance curve's steps: the demo's teacher, warm start and stage-1 cache, then for each
seed and arm one stage-2 run taken a checkpoint at a time (`--stop-at-step`; a run continued from
its checkpoint equals an uninterrupted one bit for bit), each checkpoint exported and evaluated on
the pre-registered metrics, and the report. A rerun reuses every finished evaluation, the newest
checkpoint of each run, the cache and the warm start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from apps.demo.arms import ArmRun, Tables, arm_folder, run_stage2
from apps.demo.run import (
    StepTimings,
    check_stage_tables,
    eval_path,
    evaluate_models,
    make_warm_start,
    score_train_docs,
    teacher_folder,
    warm_start_done,
)
from experiments.curve.config import CurveConfig
from experiments.curve.report import point_name, write_curve_report
from pipeline.errors import ConfigError
from pipeline.log import get_logger
from stage2_train.checkpoint import MARKER, complete_checkpoints, step_dir
from stage2_train.export import export_checkpoint

log = get_logger("curve").info


def check_curve(config: CurveConfig, manifest: Path) -> Tables:
    """The demo's checks of every table, and that the last checkpoint is the run's end."""
    tables = check_stage_tables(config, manifest)
    if (max_steps := tables.stage2.optimizer.max_steps) != config.checkpoints[-1]:
        raise ConfigError(
            f"{manifest}: [stage2] max_steps is {max_steps}, but the last of "
            f"[curve] checkpoints is {config.checkpoints[-1]}: they must be the same step"
        )
    return tables


def evaluate_point(
    config: CurveConfig, settings: dict, manifest: Path, cache: Path, student: Path,
    arm: str, seed: int, step: int,
) -> None:  # fmt: skip
    """Train `arm` with `seed` on to `step` (from its newest checkpoint), export that checkpoint
    and evaluate it; the exported model and older checkpoints are removed (disk)."""
    run = ArmRun(f"{arm}-seed{seed}", arm, seed, options={"stop_at_step": step, "resume": "auto"})
    out = arm_folder(config, run.name)
    checkpoint = step_dir(out, step)
    if not (checkpoint / MARKER).exists():
        run_stage2(config, manifest, cache, student, run)
    name = point_name(arm, seed, step)
    model = export_checkpoint(checkpoint, config.out / "models" / name, overwrite=True)
    evaluate_models(config, settings, {name: model})
    shutil.rmtree(model)
    for earlier, folder in complete_checkpoints(out):
        if earlier < step:  # a continued run starts from the newest
            shutil.rmtree(folder)


def run_curve(config: CurveConfig, manifest: Path) -> Path:
    stage2, settings, prereg = check_curve(config, manifest)
    config.out.mkdir(parents=True, exist_ok=True)
    steps = StepTimings(config.out)
    teacher = teacher_folder(config, steps)
    log(f"warm start: {config.student}, {config.warm_start_steps} plain steps")
    student = steps.timed("warm-start", warm_start_done(config), make_warm_start, config, stage2)
    cache = score_train_docs(config, manifest, teacher, steps)
    steps.timed(
        "eval-warm-start", eval_path(config, "warm-start").exists(), evaluate_models,
        config, settings, {"warm-start": student},
    )  # fmt: skip
    points = [
        (seed, arm, step)
        for seed in config.seeds  # seed by seed: a run cut short has whole comparisons
        for arm in config.arms
        for step in config.checkpoints
    ]
    for number, (seed, arm, step) in enumerate(points, start=1):
        name = point_name(arm, seed, step)
        if eval_path(config, name).exists():
            continue
        log(f"{name} ({number}/{len(points)}): stage 2 to step {step}, export, evaluate")
        steps.timed(
            name, False, evaluate_point, config, settings, manifest, cache, student, arm, seed, step
        )
    results = {
        name: json.loads(eval_path(config, name).read_text())
        for name in ["warm-start", *(point_name(arm, seed, step) for seed, arm, step in points)]
    }
    return write_curve_report(
        config, manifest, prereg, results, steps.seconds, stage2.optimizer.global_batch_tokens
    )
