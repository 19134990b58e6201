"""Options of the dose-response (`[dose]` in manifests/dose-response.toml): the demo's, with a
ladder of warm-start lengths in place of one, the held-out documents that say how far each warm
start got, the seeds, and the selection diagnostic's sample. Its pre-registered comparison is the
demo's `[preregistered]` table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from apps.demo.config import WARM_START_OFFSET, DemoConfig
from pipeline.config import option

SECTION = "dose"
TRAIN_SPLIT_DOCUMENTS = 20_000  # the shipped train split (pipeline.shipped)


@dataclass
class DoseConfig(DemoConfig):
    out: Path = option(Path("runs/dose-response"), help="folder for every output")
    warm_start_ladder: list[int] = option(
        [40, 160, 480], help="warm-start lengths in optimizer steps, increasing: the dose"
    )
    heldout_docs: int = option(
        200, help="train-split documents after the warm start's, for its held-out loss"
    )
    heldout_every: int = option(40, help="steps between held-out losses of a warm start")
    plateau_tolerance: float = option(
        0.02,
        help="the longest warm start has flattened if its held-out loss fell by less than this "
        "share over its last quarter of steps",
    )
    seeds: list[int] = option([0], help="stage 2's --seed of each arm at every warm start")
    longest_seeds: list[int] = option(
        [0, 1], help="stage 2's --seed of each arm at the longest warm start"
    )
    selection_tokens: int = option(
        32_768, help="targets of each warm start's selection diagnostic (vocagno analyze selection)"
    )
    cache: str | None = option(
        None,
        help="a stage-1 cache made elsewhere (on a CPU, say) to train every arm from; unset: "
        "the teacher scores train_docs here",
    )
    earlier: list[str] = option(
        [],
        help="dose.json of earlier runs of this design: their warm starts join the plot and the "
        "longest-against-shortest comparison (a rung this run also has is this run's)",
    )
    arm_lrs: list[float] = option(
        [],
        help="peak learning rates each arm is trained at ([stage2] min_lr scaled alike), each arm "
        "compared at the one whose model has the lowest held-out loss; empty: [stage2] lr alone",
    )
    stop_after_seconds: float = option(
        0.0,
        help="stop cleanly before a warm start once this many seconds of this call have passed, "
        "or before an arm that would end past them by the longest arm's time so far; the same "
        "command continues (a run split across two calls of a leased machine); 0: no limit",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        ladder = self.warm_start_ladder
        if not ladder or ladder[0] < 1 or ladder != sorted(set(ladder)):
            raise ValueError(f"warm_start_ladder must be increasing steps of at least 1: {ladder}")
        for name in ("seeds", "longest_seeds"):
            seeds = getattr(self, name)
            if not seeds or len(set(seeds)) != len(seeds):
                raise ValueError(f"{name} must name at least one seed, each once")
        if any(lr <= 0 for lr in self.arm_lrs) or len(set(self.arm_lrs)) != len(self.arm_lrs):
            raise ValueError(f"arm_lrs must be distinct positive rates, not {self.arm_lrs}")
        missing = [path for path in self.earlier if not Path(path).is_file()]
        if missing:
            raise ValueError(f"earlier names no dose.json at {', '.join(missing)}")
        if self.stop_after_seconds < 0:
            raise ValueError(f"stop_after_seconds must not be negative: {self.stop_after_seconds}")
        if self.heldout_docs < 1 or self.heldout_every < 1 or self.selection_tokens < 1:
            raise ValueError("heldout_docs, heldout_every and selection_tokens must be >= 1")
        if WARM_START_OFFSET + self.warm_start_docs + self.heldout_docs > TRAIN_SPLIT_DOCUMENTS:
            raise ValueError(
                f"warm_start_docs + heldout_docs must be at most "
                f"{TRAIN_SPLIT_DOCUMENTS - WARM_START_OFFSET:,}: both come from the train split's "
                f"documents {WARM_START_OFFSET:,} on"
            )

    @property
    def heldout_offset(self) -> int:
        return WARM_START_OFFSET + self.warm_start_docs

    def seeds_at(self, steps: int) -> list[int]:
        return self.longest_seeds if steps == self.warm_start_ladder[-1] else self.seeds
