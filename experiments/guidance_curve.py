"""Does guidance help with longer training? The demo's comparison as a curve over the token budget
(manifests/guidance-curve.toml, pre-registered; docs/guidance-curve.md).

Reuses the demo's teacher, warm start, stage-1 cache, torchrun arms and evaluation; trains each arm
once per seed, evaluating it at every checkpoint on the same held-out problems, and writes
OUT/report.md, OUT/curve.png and OUT/curve.json. A rerun continues where the last one stopped.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.curve.config import SECTION, CurveConfig  # noqa: E402
from scripts.demo import run_entry  # noqa: E402

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "guidance-curve.toml"


def main(argv: list[str] | None = None) -> int:
    return run_entry("guidance curve", CurveConfig, SECTION, __doc__, DEFAULT_MANIFEST,
                     "experiments.curve.run:run_curve", argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
