"""What changed between the settings an output was made with and a new run's: the lines every
"made differently" refusal shows (stage 1's cache identity, stage 2's checkpoint config)."""

from __future__ import annotations

import json
from typing import Any

_WIDTH = 80


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return text if len(text) <= _WIDTH else text[: _WIDTH - 3] + "..."


def setting_differences(old: dict, new: dict, ignore: frozenset[str] = frozenset()) -> list[str]:
    """'key: old -> new' lines, sorted; nested tables one level deep as 'section.key'."""
    lines = []
    for key in sorted((set(old) | set(new)) - ignore):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            lines += [f"{key}.{line}" for line in setting_differences(a, b)]
        else:
            lines.append(f"{key}: {_short(a)} -> {_short(b)}")
    return lines
