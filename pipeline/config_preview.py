"""What a command will run, before it runs: `--print-config` and `--dry-run`, for any command
whose options are a config dataclass (pipeline.config).

- `--print-config` prints every option's value and where it came from (`default`, `manifest` or
  `flag`), in --help's order, as a TOML manifest (`--manifest` takes it back: the same config),
  and exits; as litgpt's `--print_config` does.
- `--dry-run` prints the same and then the command's plan: what its `auto` switches resolve to
  and what the run would do (the stage says what: stage 2 its steps, accumulation and memory),
  and exits without writing, loading weights or starting workers. A stage may offer flags that
  assume what the dry run cannot see here (`--assume-world-size 8`), each labeled in its output.

A stage parses its command line with `parse_command` instead of `parse_config`, and adds its
assumption flags to the group `assumptions` is handed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from pipeline.config import (
    build_parser,
    config_from_options,
    declared,
    grouped_table,
    load_manifest_section,
    value_of,
)
from pipeline.errors import ConfigError

PREVIEWS = ("print_config", "dry_run")


class Command(NamedTuple):
    """A parsed command line: the config, each option's source by its key (`default`,
    `manifest` or `flag`), and the flags that are no option (`--dry-run`, the assumptions)."""

    config: Any
    sources: dict[str, str]
    flags: argparse.Namespace

    @property
    def previewing(self) -> bool:
        return self.flags.print_config or self.flags.dry_run


def parse_command(
    cls: type,
    argv: list[str] | None,
    description: str,
    section: str,
    assumptions: Callable[[argparse._ArgumentGroup], None] | None = None,
) -> Command:
    """`parse_config` with the sources recorded and `--print-config`/`--dry-run` offered (and
    the stage's assumption flags, added by `assumptions` to the dry run's group)."""
    parser = build_parser(cls, description, section)
    group = parser.add_argument_group(
        "print before running", "print what would run and exit: nothing written, nothing loaded"
    )
    group.add_argument("--print-config", action="store_true", help="print every option's value "
        "and where it came from (default, manifest, flag), as a TOML manifest, and exit")  # fmt: skip
    group.add_argument("--dry-run", action="store_true", help="print the options, each auto "
        "switch as resolved on this machine and the run's plan, and exit")  # fmt: skip
    if assumptions is not None:
        assumptions(group)
    given = vars(parser.parse_args(argv))
    options = {d.key for d in declared(cls)} | {"manifest"}
    flags = {key: given.pop(key) for key in list(given) if key not in options}
    assumed = [key for key, value in flags.items() if key not in PREVIEWS and value is not None]
    if assumed and not flags["dry_run"]:
        raise ConfigError(f"--{assumed[0].replace('_', '-')} is an assumption of --dry-run; "
                          "add --dry-run or drop it")  # fmt: skip
    config = config_from_options(cls, given, section)
    return Command(config, option_sources(cls, given, section), argparse.Namespace(**flags))


def option_sources(cls: type, given: dict[str, Any], section: str) -> dict[str, str]:
    """Where each option's value came from, by config_from_options' precedence: `flag` (on the
    command line), `manifest` (its [section] table), else `default`."""
    manifest = given.get("manifest")
    table = {} if manifest is None else load_manifest_section(manifest, section)
    table = grouped_table(cls, table, str(manifest))
    return {
        d.key: "flag" if d.key in given else "manifest" if d.key in table else "default"
        for d in declared(cls)
    }


def options_listing(command: Command, section: str) -> str:
    """Every option as `key = value  # source`, under its group's table in --help's order (a
    TOML manifest of the config); an unset option (None) is a comment, as TOML has no null."""
    lines, table = [], None
    for option in sorted(declared(type(command.config)), key=_help_order(command.config)):
        name = section if option.group is None else f"{section}.{option.group}"
        if name != table:
            lines += ["", f"[{name}]"] if lines else [f"[{name}]"]
            table = name
        value = value_of(command.config, option.key)
        line = f"# {option.key} unset" if value is None else f"{option.key} = {_toml(value)}"
        lines.append(f"{line:<40} # {command.sources[option.key]}")
    return "\n".join(lines)


def _help_order(config: Any) -> Callable:
    """--help's order: the options of no group first, then each group where it first appears."""
    groups: list[str | None] = [None]
    for option in declared(type(config)):
        if option.group not in groups:
            groups.append(option.group)
    return lambda option: groups.index(option.group)  # sorted() keeps declared order within


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string, escapes and all
