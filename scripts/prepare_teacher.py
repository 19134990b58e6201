"""Prepare the offline SmolLM2-135M-Instruct teacher and print its folder on stdout.

Usage: python scripts/prepare_teacher.py [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.errors import exit_code  # noqa: E402
from pipeline.log import configure  # noqa: E402
from pipeline.models.teacher_assets import prepare_smollm2_teacher  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache root (default: $VOCAGNO_CACHE or ~/.cache/vocagno)",
    )
    args = parser.parse_args(argv)
    configure()
    return exit_code("prepare_teacher", lambda: print(prepare_smollm2_teacher(args.cache_dir)))


if __name__ == "__main__":
    sys.exit(main())
