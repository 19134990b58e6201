"""The options that bring several teachers' caches into one run (--more-caches, --combine-teachers
and --source-teachers; docs/several-teachers.md), checked alike by stage 2 and by
`vocagno analyze selection`. Each refusal is one line that names the option."""

from __future__ import annotations

import os
from collections.abc import Sequence

from pipeline.storage import as_location


def source_teachers(
    cache: str | os.PathLike,
    more_caches: Sequence[str | os.PathLike],
    combine: str,
    entries: Sequence[str],
) -> dict[str, str]:
    """The caches are all different, and `entries` (`SOURCE=CACHE` each: a corpus source as the
    cache's manifest names it, and --cache or one of --more-caches) are given exactly when
    `combine` is `source`. Returns source -> that cache's location, as the run spells it."""
    locations = [str(as_location(c)) for c in (cache, *more_caches)]
    if len(set(locations)) < len(locations):
        raise ValueError("--more-caches names a cache twice, or --cache again")
    if (combine == "source") != bool(entries) or (entries and not more_caches):
        raise ValueError(
            "--combine-teachers source and --source-teachers SOURCE=CACHE ... go together, "
            "with --more-caches"
        )
    chosen: dict[str, str] = {}
    for entry in entries:
        source, _, location = entry.partition("=")
        location = str(as_location(location)) if location else ""
        if not source or location not in locations:
            raise ValueError(
                f"--source-teachers {entry!r}: need SOURCE=CACHE, CACHE one of --cache and "
                f"--more-caches ({', '.join(locations)})"
            )
        if chosen.setdefault(source, location) != location:
            raise ValueError(f"--source-teachers names two teachers for {source!r}")
    return chosen
