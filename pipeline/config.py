"""Typed dataclass configuration: one definition gives the command line, the TOML manifest and
the JSON saved beside every output.

Precedence: dataclass defaults < the manifest's `[section]` table < options given on the command
line. Every source of a value (flags, a manifest table, a config saved beside an output) goes
through `from_dict`, which checks each value against its field's type hint (types, and the
choices of a `Literal`) and then builds the dataclass, whose `__post_init__` checks ranges: a
manifest value gets exactly the checks of the same value on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import ConfigError
from pipeline.option_values import SEED_OPTION, Refused, check_seeds, finite, no_credentials

T = TypeVar("T")


HELP_CHARACTERS = 300  # an option's --help text at most: a sentence or two, the detail in docs/


def option(default: Any = dataclasses.MISSING, help: str = "", group: str | None = None) -> Any:
    """A dataclass field with its --help text and the `group` of options it is listed under (the
    component that reads it); its type hint gives type and choices."""
    metadata = {"help": help, "group": group}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: default.copy(), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def options_of(group: str) -> Any:
    """`option` for one group's options: `DATA = options_of("data")`, then `x: int = DATA(...)`."""
    return functools.partial(option, group=group)


def _scalar_type(hint: Any) -> Any:
    """`int | None` -> int; `Literal["a", "b"]` -> str."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _scalar_type(args[0])
    if typing.get_origin(hint) is typing.Literal:
        return type(typing.get_args(hint)[0])
    return hint


def _choices(hint: Any) -> tuple | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if typing.get_origin(arg) is typing.Literal:
                return typing.get_args(arg)
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return None


class _ArgumentParser(argparse.ArgumentParser):
    """A bad flag is a ConfigError: one line and exit code 2 from `exit_code`, as a bad manifest
    value is, instead of argparse's usage text."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def build_parser(cls: type, description: str, section: str) -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=argparse.SUPPRESS,
        help=f"TOML job manifest; its [{section}] table sets any option below "
        "(options on the command line win)",
    )
    hints = typing.get_type_hints(cls)
    groups: dict[str | None, Any] = {None: parser}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        group = f.metadata.get("group")
        if group not in groups:  # listed in the order the dataclass first names them
            groups[group] = parser.add_argument_group(f"{group} options")
        add_argument = groups[group].add_argument
        hint = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if f.default is not dataclasses.MISSING:
            help_text += f" (default: {f.default!r})"
        elif f.default_factory is not dataclasses.MISSING:
            help_text += f" (default: {f.default_factory()!r})"
        else:
            help_text += " (required)"
        kind = _scalar_type(hint)
        if kind is bool:
            add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        elif typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            add_argument(
                flag,
                type=_scalar_type(item),
                choices=_choices(item),
                nargs="+",
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            add_argument(
                flag,
                type=kind,
                choices=_choices(hint),
                default=argparse.SUPPRESS,
                help=help_text,
            )
    return parser


# Every table some command reads (each command's SECTION, and the demo's pre-registration);
# tests/test_config_validation.py holds this list to those constants. A table outside it is
# refused, so that a misspelled one ([stage_1]) is not ignored without a word.
MANIFEST_TABLES = (
    "stage1", "stage2", "eval", "analyze", "demo", "curve", "dose", "regime", "arms", "preregistered"
)


def load_manifest_section(path: Path, section: str) -> dict[str, Any]:
    """The `[section]` table of a TOML manifest (or the top level if it has no such table)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"manifest {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"manifest {path} is not valid TOML: {exc}") from exc
    for name, value in data.items():
        if isinstance(value, dict) and name not in MANIFEST_TABLES:
            close = difflib.get_close_matches(name, MANIFEST_TABLES, n=1)
            hint = f"did you mean [{close[0]}]? " if close else ""
            raise ConfigError(
                f"manifest {path}: no command reads a [{name}] table; {hint}the tables are "
                + ", ".join(f"[{table}]" for table in MANIFEST_TABLES)
            )
    if section in data:
        # A table inside the section is a misplaced value, for the type check to refuse.
        table = data[section]
    else:
        table = {k: v for k, v in data.items() if not isinstance(v, dict)}
    return {k.replace("-", "_"): v for k, v in table.items()}


def _show(value: Any) -> str:
    """A value as the user wrote it: TOML and JSON spell strings with double quotes."""
    try:
        return json.dumps(str(value) if isinstance(value, Path) else value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _kind_of(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "a boolean"
    names = ((int, "an integer"), (float, "a float"), (str, "a string"), (list, "a list"))
    return next(
        (name for kind, name in names if isinstance(value, kind)), f"a {type(value).__name__}"
    )


def _expected(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _expected(_optional_of(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(_show(c) for c in typing.get_args(hint))
    if origin is list:
        return f"a list of {_expected(typing.get_args(hint)[0])}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, "a path (a string)" if hint is Path else str(hint))


def _optional_of(hint: Any) -> Any:
    """`X` of `X | None`, keeping a Literal (where `_scalar_type` gives its value type)."""
    return next(arg for arg in typing.get_args(hint) if arg is not type(None))


def _checked(hint: Any, value: Any) -> Any:
    """`value` if it fits `hint` (an int widened to a float, a string made a Path), else Refused.

    Strict on purpose: a string is never a bool or a number, a float is never an int, so that a
    typo in a manifest ("false", "no", 1.5) cannot silently become another setting.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        return _checked(_optional_of(hint), value)
    if origin is typing.Literal:
        if isinstance(value, str) and value in typing.get_args(hint):
            return value
    elif origin is list:
        if isinstance(value, list | tuple):
            item, items = typing.get_args(hint)[0], []
            for index, element in enumerate(value):
                try:
                    items.append(_checked(item, element))
                except Refused as exc:
                    raise Refused(f"item {index + 1}: {exc}") from None
            return items
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return finite(float(value))
    elif hint is str:
        if isinstance(value, str):
            return no_credentials(value)
    elif hint is Path:
        if isinstance(value, str | Path):
            return Path(no_credentials(value))
    kind = "is not allowed" if _scalar_type(hint) is type(value) else f"is {_kind_of(value)}"
    raise Refused(f"{_show(value)} {kind}; expected {_expected(hint)}")


def check_options(
    cls: type, values: dict[str, Any], where: str, flags: bool = False
) -> dict[str, Any]:
    """`values` (with any group sub-tables merged in) with each checked against its field of
    `cls`: the first misfit is a ConfigError naming `where`, the key (as `--flag` if `flags`),
    the value and what is allowed."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = grouped_table(cls, values, where)
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {unknown}; known: {sorted(names)}")
    checked = {}
    for key, value in values.items():
        try:
            checked[key] = _checked(hints[key], value)
            if SEED_OPTION.search(key):
                check_seeds(checked[key])
        except Refused as exc:
            name = "--" + key.replace("_", "-") if flags else key
            raise ConfigError(f"{where} {name}: {exc}") from None
    return checked


def option_groups(cls: type) -> dict[str, str | None]:
    """Each option of `cls` -> the group it is listed under (--help, a manifest's sub-tables)."""
    return {f.name: f.metadata.get("group") for f in dataclasses.fields(cls) if f.init}


def grouped_table(cls: type, table: dict[str, Any], where: str) -> dict[str, Any]:
    """A manifest table with its group sub-tables (`[stage1.corpus]`) merged in: a sub-table may
    hold only its group's options, and a flat option (the older spelling) still counts."""
    groups = option_groups(cls)
    flat = {key: value for key, value in table.items() if not isinstance(value, dict)}
    for name, sub in table.items():
        if not isinstance(sub, dict):
            continue
        if name not in groups.values():
            known = ", ".join(sorted({g for g in groups.values() if g}))
            said = f"the groups are {known}" if known else "its options are not grouped"
            raise ConfigError(f"{where}: no option group [{name}]; {said}")
        for key, value in sub.items():
            key = key.replace("-", "_")
            if groups.get(key, name) != name:
                raise ConfigError(
                    f"{where}.{name}: {key} is a [{groups[key]}] option, not a [{name}] one"
                )
            if key in flat:
                raise ConfigError(f"{where}: {key} is set twice (flat and in [{name}])")
            flat[key] = value
    return flat


def _build(cls: type[T], values: dict[str, Any], where: str) -> T:
    """`cls` from checked values; its `__post_init__` checks ranges and how options combine."""
    missing = sorted(
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in values
    )
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ConfigError(f"{where}: missing required option(s) {flags}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def from_dict(cls: type[T], values: dict[str, Any], where: str = "config") -> T:
    """A validated `cls` from one source of values (a manifest table, a saved config)."""
    return _build(cls, check_options(cls, values, where), where)


def config_from_options(cls: type[T], given: dict[str, Any], section: str) -> T:
    """Merge explicitly given options over a `manifest` entry's [section] table into a `cls`.

    Each source is checked on its own, so that a bad value is reported where it was written.
    """
    given = dict(given)
    values: dict[str, Any] = {}
    sources = []
    manifest = given.pop("manifest", None)
    if manifest is not None:
        where = f"{manifest} [{section}]"
        values.update(check_options(cls, load_manifest_section(manifest, section), where))
        sources.append(where)
    if given or not sources:
        values.update(check_options(cls, given, "command line", flags=True))
        sources.append("command line")
    return _build(cls, values, " and ".join(sources))


def parse_config(cls: type[T], argv: list[str] | None, description: str, section: str) -> T:
    """Parse the command line (and `--manifest`) into a validated `cls`."""
    parser = build_parser(cls, description, section)
    return config_from_options(cls, vars(parser.parse_args(argv)), section)


def to_dict(config: Any) -> dict[str, Any]:
    """JSON-able view (paths as strings) to save beside outputs and to fingerprint."""
    return {key: _jsonable(value) for key, value in dataclasses.asdict(config).items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    return str(value) if isinstance(value, Path) else value
