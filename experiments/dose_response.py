"""When does the cache make a better student? The demo's comparison, with the cache's distillation
arms beside it, from warm starts of increasing length (manifests/dose-response.toml,
pre-registered; docs/dose-response.md).

Scores one cache with the teacher (loss, top-k and space columns), trains the student plainly for
each warm-start length, measures what selection keeps at each (vocagno analyze selection), trains
every arm from each for the same budget, evaluates them on the same held-out problems, and writes
OUT/report.md, OUT/dose.png and OUT/dose.json. A rerun continues where the last one stopped.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.dose.config import SECTION, DoseConfig  # noqa: E402
from scripts.demo import run_entry  # noqa: E402

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "dose-response.toml"


def main(argv: list[str] | None = None) -> int:
    return run_entry("dose-response", DoseConfig, SECTION, __doc__, DEFAULT_MANIFEST,
                     "experiments.dose.run:run_dose", argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
