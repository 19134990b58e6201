"""Options of the guidance curve (`[curve]` in manifests/guidance-curve.toml): the demo's, plus the
training seeds and the steps at which every arm is evaluated. Its pre-registered comparison is the
demo's `[preregistered]` table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from apps.demo.config import DemoConfig
from pipeline.config import option

SECTION = "curve"


@dataclass
class CurveConfig(DemoConfig):
    out: Path = option(Path("runs/guidance-curve"), help="folder for every output of the curve")
    seeds: list[int] = option(
        [0, 1, 2],
        help="stage 2's --seed of each repetition (data order and random selection; the warm "
        "start and the evaluation problems stay fixed)",
    )
    checkpoints: list[int] = option(
        [2, 4, 8, 16, 32, 64, 128, 256],
        help="steps at which every arm is evaluated, increasing; the last is [stage2] max_steps",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds must name at least one seed, each once")
        steps = self.checkpoints
        if not steps or steps[0] < 1 or steps != sorted(set(steps)):
            raise ValueError(f"checkpoints must be increasing steps of at least 1, not {steps}")
