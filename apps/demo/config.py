"""Options of the demo itself (`[demo]` in manifests/demo.toml) and its pre-registered comparison
(`[preregistered]`); stages read their own tables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config import option
from pipeline.guidance_modes import GUIDANCE_MODES, GuidanceMode

SECTION = "demo"
# What `vocagno eval` reports per problem or document, so the report can bootstrap over them.
Metric = Literal["answer_bits", "answer_accuracy", "bits_per_character", "last_word_accuracy"]
PREREGISTERED = "preregistered"
WARM_START_OFFSET = 10_000  # warm-start documents start here in the 20,000-document train split


@dataclass
class DemoConfig:
    out: Path = option(Path("runs/demo"), help="folder for every output of the demo")
    train_docs: int = option(
        200,
        help="continual-pretraining documents (the first of the train split) the teacher scores",
    )
    student: str = option("llama-demo", help="stage-2 student preset the warm start trains")
    student_tokenizer: str = option("tinyllama", help="the student's tokenizer")
    warm_start_docs: int = option(
        400, help=f"documents of the plain warm start, from document {WARM_START_OFFSET:,} on"
    )
    warm_start_steps: int = option(40, help="optimizer steps of the warm start")
    warm_start_lr: float = option(3e-3, help="peak learning rate of the warm start")
    warm_start_min_lr: float = option(3e-4, help="final learning rate of the warm start")
    warm_start_warmup: int = option(4, help="warmup steps of the warm start")
    arms: list[GuidanceMode] = option(
        ["none", "token", "random"], help="--guidance of each training arm"
    )
    nproc_per_node: int = option(2, help="torchrun ranks per arm (and warm-start threads)")
    ray_cpus: int = option(2, help="CPUs of the local Ray cluster")
    teacher: str | None = option(
        None, help="teacher model folder; unset: SmolLM2-135M-Instruct, prepared offline"
    )

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not self.arms:
            raise ValueError("arms must name at least one guidance mode")
        for name in ("train_docs", "warm_start_docs", "warm_start_steps", "nproc_per_node",
                     "ray_cpus"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.train_docs > WARM_START_OFFSET:
            raise ValueError(
                f"train_docs must be at most {WARM_START_OFFSET:,}: the warm start's documents "
                "begin there and the two slices must not overlap"
            )


@dataclass(frozen=True)
class PreRegistration:
    """What the demo compares and how it decides, fixed in the manifest before any run."""

    primary: Metric = option(
        "answer_bits", help="primary metric: answer bits per character given the question"
    )
    secondary: list[Metric] = option(
        ["answer_accuracy", "bits_per_character"], help="secondary metrics, reported alike"
    )
    comparisons: list[str] = option(
        ["token-none", "random-none", "token-random"], help="arm pairs 'a-b': metric(a) - metric(b)"
    )
    resamples: int = option(10_000, help="paired bootstrap resamples over problems")
    seed: int = option(0, help="seed of the bootstrap")
    confidence: float = option(0.95, help="confidence of the bootstrap interval")

    def __post_init__(self) -> None:
        self.check_arm_names()
        if self.resamples < 100 or not 0 < self.confidence < 1:
            raise ValueError("resamples must be >= 100 and confidence in (0, 1)")

    def check_arm_names(self) -> None:
        """The demo's arms are guidance modes (an experiment with arms of its own names checks
        them against its arms instead)."""
        self.pairs()

    def pairs(self, arms: tuple[str, ...] = GUIDANCE_MODES) -> list[tuple[str, str]]:
        """The comparisons as (a, b) pairs of `arms` (an experiment names its own arms)."""
        return [_arm_pair(pair, arms) for pair in self.comparisons]


def _arm_pair(pair: str, arms: tuple[str, ...]) -> tuple[str, str]:
    """'token-none' -> ('token', 'none'); arm names may hold '-' themselves (random-chunk)."""
    splits = [
        (pair[:i], pair[i + 1 :])
        for i, char in enumerate(pair)
        if char == "-" and pair[:i] in arms and pair[i + 1 :] in arms
    ]
    if len(splits) != 1:
        raise ValueError(f"comparisons: {pair!r} is not 'arm-arm' of {', '.join(arms)}")
    return splits[0]
