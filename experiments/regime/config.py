"""Options of the regime experiment (`[regime]` and `[arms]` in manifests/regime.toml): the
corpus and its seeded splits, the plateau-driven warm start, the regime gate, the arms (each a
table of stage-2 options), their rates and seeds. The pre-registered comparison is the demo's
`[preregistered]` table, its arm names this experiment's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from apps.demo.config import PreRegistration
from pipeline.config import option
from pipeline.shipped import CORPUS_SPLITS

SECTION = "regime"
ARMS = "arms"


@dataclass
class RegimeConfig:
    out: Path = option(Path("runs/regime"), help="folder for every output")
    corpus: str = option(
        "kjv", help="a shipped corpus split (pipeline.shipped) or a JSON lines file, one document "
        "a line with its text in `text`"
    )  # fmt: skip
    split_seed: int = option(0, help="seed of the documents' order that makes the splits")
    test_docs: int = option(100, help="documents of the test part (the result), first in order")
    validation_docs: int = option(
        60, help="documents of the validation part (held-out curve, rate choice), next"
    )
    cpt_docs: int = option(160, help="continual-pretraining documents stage 1 scores, next")
    student: str = option("llama-demo", help="stage-2 student preset the warm start trains")
    student_tokenizer: str = option("tinyllama", help="the student's tokenizer")
    warm_start_lr: float = option(3e-3, help="the warm start's rate, held after its warm-up")
    warm_start_warmup: int = option(20, help="warm-up steps of the warm start")
    warm_start_max_steps: int = option(4000, help="most steps of the warm start")
    heldout_every: int = option(100, help="steps between the warm start's held-out losses")
    plateau_every: int = option(
        400, help="the plateau test runs at every multiple of this many steps"
    )
    plateau_min_steps: int = option(800, help="the plateau test runs from this step on")
    plateau_tolerance: float = option(
        0.02, help="plateau: the held-out loss fell by less than this share over the last quarter"
    )
    gate_margin: float = option(
        0.15, help="gate: the teacher's test bits/char at least this share below the warm start's"
    )
    rates: list[float] = option(
        [3e-3, 1e-3], help="peak rates of each arm at seed 0; the lower validation bits/char wins"
    )
    arms: list[str] = option(
        ["none", "token", "random", "rho1", "uld", "alm"], help="arms, each a table in [arms]"
    )
    seeded_arms: list[str] = option(
        ["none", "token", "random", "rho1"], help="arms that run every seed (the rest seed 0)"
    )
    seeds: list[int] = option([0, 1, 2], help="stage 2's --seed of the seeded arms; the first "
                              "chooses the rates")  # fmt: skip
    selection_tokens: int = option(32_768, help="targets of the warm start's selection diagnostic")
    nproc_per_node: int = option(2, help="torchrun ranks per arm (and warm-start threads)")
    ray_cpus: int = option(2, help="CPUs of the local Ray cluster")
    teacher: str | None = option(
        None, help="teacher model folder; unset: SmolLM2-135M-Instruct, prepared offline"
    )
    cache: str | None = option(
        None, help="a stage-1 cache of this design's continual-pretraining part made elsewhere "
        "(on a CPU, by a teacher_only run); unset: the teacher scores the part here"
    )  # fmt: skip
    teacher_eval: str | None = option(
        None, help="the teacher's evaluation on this design's test part made elsewhere (the "
        "teacher_only run's OUT/eval/teacher-test.json); unset: the teacher is evaluated here"
    )  # fmt: skip
    teacher_only: bool = option(
        False, help="only the teacher's steps (the splits, stage 1 into OUT/cache, the teacher's "
        "test evaluation into OUT/eval/teacher-test.json), then stop: the GPU form's CPU half"
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.corpus not in CORPUS_SPLITS and not Path(self.corpus).is_file():
            raise ValueError(f"corpus {self.corpus!r} is neither a shipped split "
                             f"({', '.join(CORPUS_SPLITS)}) nor a file")  # fmt: skip
        for name in ("test_docs", "validation_docs", "cpt_docs", "warm_start_max_steps",
                     "heldout_every", "plateau_every", "selection_tokens", "nproc_per_node",
                     "ray_cpus"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.plateau_every % (4 * self.heldout_every):
            raise ValueError("plateau_every must be a multiple of 4 x heldout_every, so that 3/4 "
                             "of each tested step has a held-out loss")  # fmt: skip
        for name in ("plateau_tolerance", "gate_margin"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be a share in (0, 1)")
        if not self.rates or any(not (math.isfinite(r) and r > 0) for r in self.rates):
            raise ValueError(f"rates must be positive finite peak rates, not {self.rates}")
        if len(set(self.rates)) != len(self.rates):
            raise ValueError(f"rates must be distinct: {self.rates}")
        if not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError("arms must name at least one arm, each once")
        if not set(self.seeded_arms) <= set(self.arms):
            raise ValueError(f"seeded_arms {self.seeded_arms} must be among arms {self.arms}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds must name at least one seed, each once")
        if self.teacher_only:  # it makes what they name: they must name what it makes
            for name, made in (("cache", self.out / "cache"),
                               ("teacher_eval", self.teacher_eval_path)):  # fmt: skip
                given = getattr(self, name)
                if given is not None and Path(given).resolve() != made.resolve():
                    raise ValueError(f"teacher_only makes {made}, but {name} names {given}")

    @property
    def teacher_eval_path(self) -> Path:
        """Where the teacher's test evaluation is kept (the report reads it there)."""
        return self.out / "eval" / "teacher-test.json"

    @property
    def rate_seed(self) -> int:
        return self.seeds[0]

    def seeds_of(self, arm: str) -> list[int]:
        return self.seeds if arm in self.seeded_arms else [self.rate_seed]


@dataclass(frozen=True)
class RegimePreRegistration(PreRegistration):
    """The demo's pre-registered comparison over this experiment's arm names (`rho1` is no
    guidance mode): the runner checks them against [regime] arms before anything runs."""

    def check_arm_names(self) -> None:
        pass
