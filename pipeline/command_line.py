"""How a config's options read on the command line: a bad flag as one line, each option's help
with its default once, and descriptions that keep their lines (pipeline.config.build_parser)."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import typing

from pipeline.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """A bad flag is a ConfigError: one line and exit code 2 from `exit_code`, as a bad manifest
    value is, instead of argparse's usage text."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def option_help(field: dataclasses.Field) -> str:
    """An option's --help: its text and its default, once (a text that says its default in
    words, "default: the student's own", keeps its words)."""
    text = field.metadata.get("help", "")
    if "default:" in text:
        return text
    if field.default is not dataclasses.MISSING:
        return text + f" (default: {field.default!r})"
    if field.default_factory is not dataclasses.MISSING:
        return text + f" (default: {field.default_factory()!r})"
    return text + " (required)"


class LineKeepingFormatter(argparse.HelpFormatter):
    """Wraps each line of a description on its own: a section's overview (its `help_overview()`,
    e.g. stage 2's guidance modes, one a line) keeps its lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = text.splitlines()
        hanging = indent + "  " if len(lines) > 1 else indent
        return "\n".join(
            textwrap.fill(line, width, initial_indent=indent, subsequent_indent=hanging)
            for line in lines
        )
