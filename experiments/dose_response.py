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
from pipeline.config import parse_config  # noqa: E402
from pipeline.errors import exit_code  # noqa: E402
from pipeline.log import configure  # noqa: E402
from scripts.demo import manifest_argument  # noqa: E402

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "dose-response.toml"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return exit_code("dose-response", lambda: _dose(argv))


def _dose(argv: list[str]) -> None:
    argv, manifest = manifest_argument(argv, DEFAULT_MANIFEST)
    config = parse_config(DoseConfig, argv, __doc__, SECTION)
    configure(separated=True)  # Ray's and torchrun's output runs between the experiment's lines
    from experiments.dose.run import run_dose

    run_dose(config, manifest)


if __name__ == "__main__":
    sys.exit(main())
