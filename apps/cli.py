"""The `vocagno` command. Each subcommand lives in its own module under `apps.commands` and
exposes `add_parser(subparsers)`; heavy imports stay inside the command so `--help` is instant."""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeline.errors import exit_code
from pipeline.log import configure

COMMAND_MODULES = (
    "align",
    "analyze",
    "cache",
    "eval",
)
# A command folded into another, refused in one line that says what replaced it.
REPLACED = {
    "overlap": "vocagno analyze overlap --student-tokenizer S --teacher-tokenizers T --out DIR "
    "(DIR/vocab_overlap.json holds the same keys, a row per teacher)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vocagno",
        description="Vocabulary-agnostic teacher-guided language modeling: tools around the "
        "teacher-loss cache (stage 1: stage1_score/run.py, stage 2: stage2_train/train.py).",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"apps.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in REPLACED:
        print(f"vocagno {argv[0]}: error: replaced by {REPLACED[argv[0]]}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    configure()
    try:
        return exit_code(f"vocagno {args.command}", lambda: args.func(args))
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
