"""Typed dataclass configuration: one definition gives the command line, the TOML manifest and
the JSON saved beside every output.

Precedence: dataclass defaults < the manifest's `[section]` table < options given on the command
line. Validation lives in each dataclass's `__post_init__`, so every path in gets the same checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import ConfigError

T = TypeVar("T")


def option(default: Any = dataclasses.MISSING, help: str = "", **extra: Any) -> Any:
    """A dataclass field with its --help text (and optional `choices`)."""
    metadata = {"help": help, **extra}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: default.copy(), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


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


def build_parser(cls: type, description: str, section: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
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
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        elif typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            parser.add_argument(flag, type=item, nargs="+", default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(
                flag,
                type=kind,
                choices=f.metadata.get("choices") or _choices(hint),
                default=argparse.SUPPRESS,
                help=help_text,
            )
    return parser


def load_manifest_section(path: Path, section: str) -> dict[str, Any]:
    """The `[section]` table of a TOML manifest (or the top level if it has no such table)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"manifest {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"manifest {path} is not valid TOML: {exc}") from exc
    table = data.get(section, data)
    return {k.replace("-", "_"): v for k, v in table.items() if not isinstance(v, dict)}


def from_dict(cls: type[T], values: dict[str, Any], where: str = "config") -> T:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {unknown}; known: {sorted(names)}")
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


def config_from_options(cls: type[T], given: dict[str, Any], section: str) -> T:
    """Merge explicitly given options over a `manifest` entry's [section] table into a `cls`."""
    given = dict(given)
    values: dict[str, Any] = {}
    where = "command line"
    manifest = given.pop("manifest", None)
    if manifest is not None:
        values.update(load_manifest_section(manifest, section))
        where = f"{manifest} [{section}] and command line"
    values.update(given)
    return from_dict(cls, values, where)


def parse_config(cls: type[T], argv: list[str] | None, description: str, section: str) -> T:
    """Parse the command line (and `--manifest`) into a validated `cls`."""
    parser = build_parser(cls, description, section)
    return config_from_options(cls, vars(parser.parse_args(argv)), section)


def to_dict(config: Any) -> dict[str, Any]:
    """JSON-able view (paths as strings) to save beside outputs and to fingerprint."""
    out = {}
    for key, value in dataclasses.asdict(config).items():
        out[key] = str(value) if isinstance(value, Path) else value
    return out
