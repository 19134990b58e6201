"""The two shapes of `vocagno` subcommand, declared once so every command reads and helps alike.

- `config_subcommand`: options are the fields of a config dataclass, `--manifest` fills gaps.
- `tokenizer_pair_subcommand`: takes a student and a teacher tokenizer; the module docstring
  (after its first paragraph) is the description, laid out as written.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pipeline.config import build_parser, config_from_options
from pipeline.tokenizer import TOKENIZER_SPEC

# argparse bookkeeping on the namespace, never a config field
_RESERVED = frozenset({"command", "analysis", "func", "config_cls", "config_section"})


def config_subcommand(
    subparsers,
    name: str,
    config_cls: type,
    section: str,
    description: str,
    func: Callable[[argparse.Namespace], int],
    help: str | None = None,
) -> argparse.ArgumentParser:
    """A subcommand whose options are the fields of `config_cls` (help text and all).

    `help` (the line in the parent's listing) defaults to the description's first sentence.
    """
    options = build_parser(config_cls, description, section)
    parser = subparsers.add_parser(
        name,
        parents=[options],
        add_help=False,  # the parent parser brings -h/--help
        help=description.split(".")[0] if help is None else help,
        description=description,
        formatter_class=options.formatter_class,
    )
    parser.set_defaults(config_cls=config_cls, config_section=section, func=func)
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    """The parsed options of a `config_subcommand` as a validated config; a --manifest table
    fills the gaps."""
    given = {k: v for k, v in vars(args).items() if k not in _RESERVED}
    return config_from_options(args.config_cls, given, args.config_section)


def tokenizer_pair_subcommand(
    subparsers, name: str, help: str, module_doc: str
) -> argparse.ArgumentParser:
    """A subcommand with --student-tokenizer S and --teacher-tokenizer T, both required."""
    parser = subparsers.add_parser(
        name,
        help=help,
        description=module_doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for side, metavar in (("student", "S"), ("teacher", "T")):
        parser.add_argument(
            f"--{side}-tokenizer",
            required=True,
            metavar=metavar,
            help=f"{side} tokenizer: {TOKENIZER_SPEC}",
        )
    return parser
