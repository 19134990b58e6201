"""`make demo`: the whole pipeline on the embedded default (manifests/demo.toml), on a CPU.

Starts a private local Ray cluster and submits stage 1 as a Ray job, trains each arm with
`torchrun --nproc-per-node 2`, evaluates teacher and students, and writes runs/demo/report.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.demo.config import SECTION, DemoConfig  # noqa: E402
from pipeline.config import parse_config  # noqa: E402
from pipeline.errors import exit_code  # noqa: E402
from pipeline.log import configure  # noqa: E402

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "demo.toml"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--manifest" not in argv:
        argv = ["--manifest", str(DEFAULT_MANIFEST), *argv]
    return exit_code("demo", lambda: _demo(argv))


def _demo(argv: list[str]) -> None:
    config = parse_config(DemoConfig, argv, __doc__, SECTION)
    configure(separated=True)  # Ray's and torchrun's output runs between the demo's lines
    from apps.demo.run import run_demo

    run_demo(config, Path(argv[argv.index("--manifest") + 1]))


if __name__ == "__main__":
    sys.exit(main())
