"""Stage 2 entry:
`torchrun --nproc-per-node N stage2_train/train.py --cache DIR --student S --out OUT ...`
(or `python stage2_train/train.py ...` as one process). Options: `--help`, or a TOML manifest's
[stage2] table via `--manifest`. No teacher model is imported or loaded here: its losses come from
the cache."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun, python): make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.errors import exit_code  # noqa: E402
from stage2_train.config import parse_train_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return exit_code("stage2_train/train.py", lambda: _train(argv))


def _train(argv: list[str] | None) -> None:
    config = parse_train_config(argv)
    from stage2_train.data.loader import worker_death
    from stage2_train.trainer import train

    try:
        final = train(config)
    except (RuntimeError, ConnectionError, EOFError) as exc:
        if not (config.data.num_workers and (died := worker_death(exc))):
            raise
        raise died from None
    if final is not None:
        print(f"final student: {final}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
