"""What an option's value must be, one place for all commands: of its field's type hint (`checked`:
types, and the choices of a `Literal`), and the rules every value meets whatever its field: no
float that is not finite, no seed numpy or torch would refuse, no location that carries
credentials. pipeline.config applies them to every source of a value."""

from __future__ import annotations

import argparse
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any


class Refused(ValueError):
    """A value that does not fit its field; the message says what is allowed."""


def no_credentials(value: str | Path) -> str | Path:
    """A location that carries credentials is refused, and shown masked (pipeline.storage)."""
    from pipeline.storage.store import credentials_in

    refusal = credentials_in(value)
    if refusal:
        raise Refused(refusal)
    return value


def finite(value: float) -> float:
    """Every float option's rule: NaN and infinities are refused, as no option means them (and
    NaN passes every range check: `nan <= 0` is false)."""
    if not math.isfinite(value):
        raise Refused(f"{value} is not allowed; expected a finite number")
    return value


def finite_float(text: str) -> float:
    """`type=` for a float option of a command parsed by argparse alone."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return finite(value)
    except Refused as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# Every seed option (`seed`, `sample_seed`, `seeds`, ...) reaches numpy's generators, which refuse
# a negative seed, and torch's, which take at most 64 bits: refused here, not in a worker or a step.
SEED_OPTION = re.compile(r"(^|_)seeds?$")
MAX_SEED = 2**63 - 1


def fitting(key: str, hint: Any, value: Any) -> Any:
    """`value` of the option `key` if it fits the option's type `hint` and its key's rules (a
    seed's range), else Refused."""
    value = checked(hint, value)
    if SEED_OPTION.search(key):
        check_seeds(value)
    return value


def check_seeds(value: int | list[int] | None) -> None:
    for seed in value if isinstance(value, list) else [value]:
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise Refused(f"{seed} is not allowed; expected a seed from 0 to 2**63 - 1")


def scalar_type(hint: Any) -> Any:
    """`int | None` -> int; `Literal["a", "b"]` -> str."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return scalar_type(args[0])
    if typing.get_origin(hint) is typing.Literal:
        return type(typing.get_args(hint)[0])
    return hint


def choices_of(hint: Any) -> tuple | None:
    """The choices of a `Literal` (alone, or in `X | None`), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if typing.get_origin(arg) is typing.Literal:
                return typing.get_args(arg)
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return None


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
    """`X` of `X | None`, keeping a Literal (where `scalar_type` gives its value type)."""
    return next(arg for arg in typing.get_args(hint) if arg is not type(None))


def checked(hint: Any, value: Any) -> Any:
    """`value` if it fits `hint` (an int widened to a float, a string made a Path), else Refused.

    Strict on purpose: a string is never a bool or a number, a float is never an int, so that a
    typo in a manifest ("false", "no", 1.5) cannot silently become another setting.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        return checked(_optional_of(hint), value)
    if origin is typing.Literal:
        if isinstance(value, str) and value in typing.get_args(hint):
            return value
    elif origin is list:
        if isinstance(value, list | tuple):
            item, items = typing.get_args(hint)[0], []
            for index, element in enumerate(value):
                try:
                    items.append(checked(item, element))
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
    kind = "is not allowed" if scalar_type(hint) is type(value) else f"is {_kind_of(value)}"
    raise Refused(f"{_show(value)} {kind}; expected {_expected(hint)}")
