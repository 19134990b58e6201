"""The method in its own regime: a student trained to its plateau on real prose (the King James
Bible, shipped), guided by a teacher that stays far stronger (manifests/regime.toml,
pre-registered; docs/regime.md).

Splits the corpus by seed, scores the continual-pretraining part with the teacher, trains the
student plainly until its plateau test passes, checks the regime gate (plateau, and the teacher
at least 15% better on the test part) before any arm runs, then trains every arm from the warm
start at two rates, chooses each arm's rate on the validation part, runs the other seeds, and
writes OUT/report.md, OUT/regime.json and OUT/regime.png. A rerun continues where the last one
stopped. At GPU scale (manifests/regime-gpu.toml), --teacher-only on a CPU makes the cache and the
teacher's evaluation, and the run on the GPU reads them (cache, teacher_eval): no teacher there.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.regime.config import SECTION, RegimeConfig  # noqa: E402
from scripts.demo import run_entry  # noqa: E402

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "regime.toml"


def main(argv: list[str] | None = None) -> int:
    return run_entry("regime", RegimeConfig, SECTION, __doc__, DEFAULT_MANIFEST,
                     "experiments.regime.run:run_regime", argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
