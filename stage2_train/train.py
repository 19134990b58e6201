"""Stage 2 entry:
`torchrun --nproc-per-node N stage2_train/train.py --cache DIR --student S --out OUT ...`
(or `python stage2_train/train.py ...` as one process). Options: `--help`, or a TOML manifest's
[stage2] table via `--manifest`. No teacher model is imported or loaded here: its losses come from
the cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun, python): make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config_preview import Command, options_listing, parse_command  # noqa: E402
from pipeline.errors import exit_code  # noqa: E402
from stage2_train.config import DESCRIPTION, SECTION, TrainConfig  # noqa: E402
from stage2_train.dry_run import add_assumptions, dry_run  # noqa: E402


def parse_train_command(argv: list[str] | None = None) -> Command:
    """The options with each one's source, and --print-config, --dry-run and the dry run's
    assumptions (stage2_train.dry_run)."""
    return parse_command(TrainConfig, argv, DESCRIPTION, SECTION, add_assumptions)


def preview(command: Command) -> None:
    """--print-config's options, or --dry-run's options and plan, on stdout (once, by rank 0
    where torchrun starts several)."""
    if os.environ.get("RANK", "0") != "0":
        return
    if not command.flags.dry_run:
        print(options_listing(command, SECTION))
        return
    for block in dry_run(command):
        print(block, flush=True)


def main(argv: list[str] | None = None) -> int:
    return exit_code("stage2_train/train.py", lambda: _train(argv))


def _train(argv: list[str] | None) -> None:
    command = parse_train_command(argv)
    if command.previewing:
        preview(command)
        return
    config = command.config
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
