"""What every runner of pre-registered arms shares (the demo, experiments/curve, dose and regime):
the check of a design's tables before anything runs, one arm's stage-2 run described
(`ArmRun`) and trained under torchrun, and the selection diagnostic of a warm start. Each runner
keeps its own steps around them and its own report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from apps.demo.config import PREREGISTERED, PreRegistration
from apps.evaluation.config import SECTION as EVAL_SECTION
from apps.evaluation.config import EvalConfig
from pipeline.config import from_dict, load_manifest_section
from pipeline.errors import ConfigError, VocagnoError
from stage2_train.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ArmRun:
    """One stage-2 run of an arm from a warm start, as options over the manifest's [stage2]:
    `name` is its folder under OUT/arms; None (seed, lr, max_steps) keeps [stage2]'s value. The
    peak rate `lr` comes with its `min_lr`, by the experiment's rule (dose: [stage2]'s scaled
    alike; regime: a tenth); `options` are further stage-2 options (an arm's table in regime)."""

    name: str
    guidance: str
    seed: int | None = None
    lr: float | None = None
    min_lr: float | None = None
    max_steps: int | None = None
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.lr is None) != (self.min_lr is None):
            raise ValueError(f"arm {self.name}: a peak lr and its min_lr come together")

    def arguments(self) -> list[str]:
        """stage2_train/train.py's flags for what this run sets over [stage2]."""
        args = ["--guidance", self.guidance]
        if self.seed is not None:
            args += ["--seed", str(self.seed)]
        if self.lr is not None:
            args += ["--lr", str(self.lr), "--min-lr", str(self.min_lr)]
        if self.max_steps is not None:
            args += ["--max-steps", str(self.max_steps)]
        return args + [f"--{key.replace('_', '-')}={value}" for key, value in self.options.items()]


def arm_folder(config, name: str) -> Path:
    return config.out / "arms" / name


def arm_done(config, name: str) -> bool:
    return (arm_folder(config, name) / "final" / "config.json").exists()


def run_stage2(config, manifest: Path, cache: Path, student: Path, run: ArmRun) -> None:
    """Stage 2 of `run` under torchrun into its folder; torchrun as this interpreter's module,
    which a Python with torch has even where no `torchrun` script sits beside the interpreter
    (a GPU machine's system Python). `config` gives the ranks, the student's tokenizer and OUT."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={config.nproc_per_node}",
        "--standalone",
        "stage2_train/train.py", "--manifest", str(manifest), "--cache", str(cache),
        "--student", str(student), "--student-tokenizer", config.student_tokenizer,
        "--out", str(arm_folder(config, run.name)), *run.arguments(),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise VocagnoError(f"stage 2 ({run.guidance}) failed with exit code {result.returncode}")


def train_arm(
    config, manifest: Path, cache: Path, student: Path, run: ArmRun, keep_checkpoints: bool = False
) -> Path:
    """The arm's folder with its final model, trained unless a run before finished it; its
    checkpoints are removed once the final model is written (disk), unless `keep_checkpoints`
    (the demo leaves its arms as stage 2 does)."""
    if not arm_done(config, run.name):
        run_stage2(config, manifest, cache, student, run)
    out = arm_folder(config, run.name)
    if not keep_checkpoints:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return out


class Tables(NamedTuple):
    """A design's tables as their readers take them: [stage2] with what every arm is given (the
    cache, the student and its tokenizer), [eval]'s settings, and the pre-registered comparison."""

    stage2: TrainConfig
    eval: dict
    prereg: PreRegistration


def check_tables(
    config, manifest: Path, corpus: str, arms: dict[str, dict], *, given: dict | None = None,
    prereg_type: type[PreRegistration] = PreRegistration, arms_table: str | None = None,
    carried: str | None = None,
) -> Tables:  # fmt: skip
    """Each stage's table checked as that stage will check it, with the options the runner gives
    it on the command line (`given`, and each arm's own options in `arms`), and across the tables
    (each arm's distillation reads columns the cache holds, the comparisons name arms): a bad
    value stops the run here, before Ray starts or anything is written, not minutes later in a
    subprocess. An arm's bad option is named in its table, `[ARMS_TABLE.ARM]`, where it has one;
    the columns are those of `carried`, a cache made elsewhere, where it is given."""
    from stage1_score.config import ScoreConfig

    def table(section: str, given: dict) -> tuple[dict, str]:
        return {**load_manifest_section(manifest, section), **given}, f"{manifest} [{section}]"

    cache = str(config.out / "cache")  # a path or URI option in both stages
    teacher = config.teacher or "SmolLM2-135M-Instruct"  # prepared later; any name checks alike
    score = from_dict(ScoreConfig, *table("stage1", {"teacher": teacher, "corpus": corpus,
                                                     "out": cache}))  # fmt: skip
    given = {"cache": cache, "student": config.student,  # the warm start is this preset, trained
             "student_tokenizer": config.student_tokenizer, "out": config.out / "arms",
             **(given or {})}  # fmt: skip
    stage2 = []
    for arm, options in arms.items():
        settings, where = table("stage2", {**given, "out": arm_folder(config, arm), **options})
        where = f"{manifest} [{arms_table}.{arm}]" if arms_table else where
        stage2.append(from_dict(TrainConfig, settings, where))
    _check_arms_columns(manifest, score, stage2, carried)
    settings, where = table(EVAL_SECTION, {})
    from_dict(EvalConfig, {**settings, "model": teacher}, where)
    prereg = from_dict(prereg_type, *table(PREREGISTERED, {}))
    try:
        prereg.pairs(tuple(arms))
    except ValueError as exc:
        raise ConfigError(f"{manifest} [{PREREGISTERED}]: {exc}") from None
    return Tables(from_dict(TrainConfig, *table("stage2", given)), settings, prereg)


def _check_arms_columns(manifest: Path, score, arms: list[TrainConfig], given: str | None) -> None:
    """Each arm's distillation reads only columns its cache will hold: a given cache's (`[dose]
    cache`), else those [stage1]'s options add."""
    from pipeline.cache.manifest import load_manifest
    from pipeline.distillation.columns import check_columns
    from stage1_score.config import result_settings

    if given and not (Path(given) / "manifest.json").is_file():
        return  # refused by name where the experiment reads it
    if given:
        settings, cache = load_manifest(given).settings, f"cache {given}"
    else:  # the columns, not their types: any head size and space mask give the same ones
        settings = result_settings(score, 2, 1, head_size=1 << 16, space_mask={"planned": True})
        cache = f"the cache {manifest} [stage1] scores"
    for arm in arms:
        distillation = arm.guidance.distillation(arm.model, settings)
        if distillation is not None:
            check_columns(arm.guidance, distillation, cache, settings, arm.model)


def selection_done(config) -> bool:
    return (config.out / "selection" / "selection.json").exists()


def selection_diagnostic(config, stage2: TrainConfig, cache: Path, student: Path) -> None:
    """`vocagno analyze selection` of the warm start into OUT/selection, with the arms' shape
    and selection ([stage2]'s) over `config.selection_tokens` targets."""
    from apps.analysis.configs import SelectionConfig
    from apps.analysis.selection import run_selection_report

    if selection_done(config):
        return
    run_selection_report(
        SelectionConfig(
            cache=str(cache), student=str(student), student_tokenizer=config.student_tokenizer,
            tokens=config.selection_tokens, seq_len=stage2.data.seq_len,
            micro_batch_size=stage2.optimizer.micro_batch_size, packing=stage2.data.packing,
            topk=stage2.guidance.topk, unmapped=stage2.guidance.unmapped,
            aggregate=stage2.guidance.aggregate, out=config.out / "selection",
        )
    )  # fmt: skip
