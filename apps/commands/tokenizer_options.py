"""Options several subcommands share."""

from __future__ import annotations

import argparse

from pipeline.tokenizer import TOKENIZER_SPEC


def add_tokenizer_pair(parser: argparse.ArgumentParser) -> None:
    """--student-tokenizer S and --teacher-tokenizer T, both required."""
    for side, metavar in (("student", "S"), ("teacher", "T")):
        parser.add_argument(
            f"--{side}-tokenizer",
            required=True,
            metavar=metavar,
            help=f"{side} tokenizer: {TOKENIZER_SPEC}",
        )
