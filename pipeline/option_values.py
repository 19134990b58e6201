"""The rules every option value meets whatever its field, one place for all commands: no float
that is not finite, no seed numpy or torch would refuse, no location that carries credentials.
pipeline.config applies them where it checks a value's type."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path


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


def check_seeds(value: int | list[int] | None) -> None:
    for seed in value if isinstance(value, list) else [value]:
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise Refused(f"{seed} is not allowed; expected a seed from 0 to 2**63 - 1")
