"""Typed dataclass configuration: one definition gives the command line, the TOML manifest and
the JSON saved beside every output.

Precedence: dataclass defaults < the manifest's `[section]` table < options given on the command
line. Every source of a value (flags, a manifest table, a config saved beside an output) goes
through `from_dict`, which checks each value against its field's type hint (types, and the
choices of a `Literal`) and then builds the dataclass, whose `__post_init__` checks ranges: a
manifest value gets exactly the checks of the same value on the command line.

A config is flat (each field an option, listed under its `group`) or made of sections: a field
whose type is a dataclass is a section, its fields that section's options, and its name their
group (`config.optimizer.lr`; --help lists the sections in the order they are declared, and a
manifest may hold them in `[stage2.optimizer]`). Outside the code an option keeps one flat name
either way: its flag (`--lr`), its manifest key (`lr`, in the stage's table or its group's) and
its key in the saved JSON (`to_dict` writes every option flat, so a config's fingerprint does not
depend on which section holds it). That name is the field's, unless `option(key=...)` gives
another: where a section and an option would share a name (stage 2's section `guidance` and its
mode, `--guidance`), the option is `mode` in the code and `guidance` outside it.

Adding an option to a section is one field in that section's dataclass, e.g.
`eval_every: int = option(0, help="...")` in stage 2's `LoggingOptions`: the flag, the manifest
key, the saved key, its place in --help and its type check follow from it; a check of its range
goes in the section's `__post_init__` (or the config's, where it needs another section's value).
A default that keeps today's behaviour keeps every saved config loading as it ran (stage 2: one a
resumed run may change joins RESUMABLE_CHANGES). Then list it in the docs' table of its command's
options, in its section, in declared order (tests/test_config_sections.py holds stage 2's).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import tomllib
import typing
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pipeline.command_line import ArgumentParser, LineKeepingFormatter, option_help
from pipeline.errors import ConfigError
from pipeline.option_values import Refused, choices_of, fitting, scalar_type

T = TypeVar("T")


HELP_CHARACTERS = 300  # an option's --help text at most: a sentence or two, the detail in docs/


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    group: str | None = None,
    key: str | None = None,
) -> Any:
    """A dataclass field with its --help text, the `group` of options it is listed under (the
    component that reads it; a section's options are in the section's group) and its `key`, the
    name of its flag, manifest key and saved key where that is not the field's name; its type
    hint gives type and choices."""
    metadata = {"help": help, "group": group, "key": key}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: default.copy(), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def options_of(group: str) -> Any:
    """`option` for one group's options: `DATA = options_of("data")`, then `x: int = DATA(...)`."""
    return functools.partial(option, group=group)


class Declared(NamedTuple):
    """One option of a config: its flat `key` (flag, manifest and saved key), the `section`
    field holding it (None: a field of the config itself), its field, type hint and group."""

    key: str
    section: str | None
    field: dataclasses.Field
    hint: Any
    group: str | None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def required(self) -> bool:
        return (
            self.field.default is dataclasses.MISSING
            and self.field.default_factory is dataclasses.MISSING
        )


def sections_of(cls: type) -> dict[str, type]:
    """The section fields of `cls` (name -> dataclass), in declared order; empty if flat."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])
    }


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    """Every option of `cls`, in declared order (a section's in its place among the fields)."""
    hints, sections = typing.get_type_hints(cls), sections_of(cls)
    found = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in sections:
            inner = typing.get_type_hints(sections[f.name])
            found += [
                Declared(g.metadata.get("key") or g.name, f.name, g, inner[g.name], f.name)
                for g in dataclasses.fields(sections[f.name])
                if g.init
            ]
        else:
            found.append(Declared(f.metadata.get("key") or f.name, None, f, hints[f.name],
                                  f.metadata.get("group")))  # fmt: skip
    keys = [d.key for d in found]
    if len(set(keys)) != len(keys):
        raise TypeError(f"{cls.__name__}: an option's key is declared twice: {sorted(keys)}")
    return tuple(found)


def option_groups(cls: type) -> dict[str, str | None]:
    """Each option of `cls` -> the group it is listed under (--help, a manifest's sub-tables)."""
    return {d.key: d.group for d in declared(cls)}


def value_of(config: Any, key: str) -> Any:
    """The value of the option spelled `key` outside the code (`lr`: `config.optimizer.lr`)."""
    option = next(d for d in declared(type(config)) if d.key == key)
    holder = config if option.section is None else getattr(config, option.section)
    return getattr(holder, option.field.name)


def from_flat(cls: type[T], values: dict[str, Any]) -> T:
    """`cls` from options by their flat keys, each section built from its own (its
    `__post_init__` first), then the config; no type checks (`from_dict` makes them first), so
    a bad value raises what the dataclasses raise. Tests and benchmarks build a config so."""
    options = {d.key: d for d in declared(cls)}
    unknown = sorted(set(values) - set(options))
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown option(s) {unknown}")
    sections, fields = sections_of(cls), {}
    parts: dict[str, dict[str, Any]] = {name: {} for name in sections}
    for key, value in values.items():
        option = options[key]
        (fields if option.section is None else parts[option.section])[option.field.name] = value
    return cls(**fields, **{name: sections[name](**part) for name, part in parts.items()})


def replaced(config: T, **changes: Any) -> T:
    """`config` with some options changed (by their flat keys), every check made again."""
    values = {d.key: value_of(config, d.key) for d in declared(type(config))}
    return from_flat(type(config), {**values, **changes})


def build_parser(cls: type, description: str, section: str) -> argparse.ArgumentParser:
    """Flags for every option of `cls`, listed by group: a sectioned config's in the order its
    sections are declared, a flat one's in the order its fields first name them."""
    parser = ArgumentParser(description=description, formatter_class=LineKeepingFormatter)
    parser.add_argument(
        "--manifest",
        type=Path,
        default=argparse.SUPPRESS,
        help=f"TOML job manifest; its [{section}] table sets any option below "
        "(options on the command line win)",
    )
    groups: dict[str | None, Any] = {None: parser}
    sections, mark = sections_of(cls), getattr(cls, "help_mark", None)  # e.g. stage 1's identity
    for option in declared(cls):
        if option.group not in groups:
            overview = getattr(sections.get(option.group), "help_overview", None)
            groups[option.group] = parser.add_argument_group(
                f"{option.group} options", overview() if overview else None
            )
        add_argument = functools.partial(
            groups[option.group].add_argument,
            option.flag,
            dest=option.key,
            default=argparse.SUPPRESS,
            help=option_help(option.field) + (f" {mark(option.key)}" if mark else ""),
        )
        kind = scalar_type(option.hint)
        if kind is bool:
            add_argument(action=argparse.BooleanOptionalAction)
        elif typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            add_argument(type=scalar_type(item), choices=choices_of(item), nargs="+")
        else:
            add_argument(type=kind, choices=choices_of(option.hint))
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


def check_options(
    cls: type, values: dict[str, Any], where: str, flags: bool = False
) -> dict[str, Any]:
    """`values` (with any group sub-tables merged in) with each checked against its option of
    `cls`: the first misfit is a ConfigError naming `where`, the key (as `--flag` if `flags`),
    the value and what is allowed."""
    options = {d.key: d for d in declared(cls)}
    values = grouped_table(cls, values, where)
    unknown = sorted(set(values) - set(options))
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {unknown}; known: {sorted(options)}")
    fits = {}
    for key, value in values.items():
        try:
            fits[key] = fitting(key, options[key].hint, value)
        except Refused as exc:
            name = options[key].flag if flags else key
            raise ConfigError(f"{where} {name}: {exc}") from None
    return fits


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
    """`cls` from checked values; each `__post_init__` checks ranges and how options combine."""
    missing = [d.flag for d in declared(cls) if d.required and d.key not in values]
    if missing:
        raise ConfigError(f"{where}: missing required option(s) {', '.join(sorted(missing))}")
    try:
        return from_flat(cls, values)
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
    """JSON-able view (paths as strings) to save beside outputs and to fingerprint: every option
    by its flat key, whichever section holds it."""
    sections, plain, flat = sections_of(type(config)), dataclasses.asdict(config), {}
    for f in dataclasses.fields(config):
        if f.name in sections:
            flat.update(to_dict(getattr(config, f.name)))
        else:
            flat[f.metadata.get("key") or f.name] = _jsonable(plain[f.name])
    return flat


def _jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    return str(value) if isinstance(value, Path) else value
