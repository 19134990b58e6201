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
from pipeline.config import parse_config  # noqa: E402
from pipeline.errors import exit_code  # noqa: E402
from pipeline.log import configure  # noqa: E402
from scripts.demo import manifest_argument  # noqa: E402

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "guidance-curve.toml"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return exit_code("guidance curve", lambda: _curve(argv))


def _curve(argv: list[str]) -> None:
    argv, manifest = manifest_argument(argv, DEFAULT_MANIFEST)
    config = parse_config(CurveConfig, argv, __doc__, SECTION)
    configure(separated=True)  # Ray's and torchrun's output runs between the curve's lines
    from experiments.curve.run import run_curve

    run_curve(config, manifest)


if __name__ == "__main__":
    sys.exit(main())
