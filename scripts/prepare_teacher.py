"""Prepare the offline SmolLM2-135M-Instruct teacher and print its folder on stdout.

Usage: python scripts/prepare_teacher.py [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.errors import exit_code
from pipeline.log import configure
from pipeline.models.teacher_assets import prepare_smollm2_teacher


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
