"""Write the shipped prose corpus (pipeline/assets/corpus/kjv-chapters.jsonl.zst): the King James
Bible, one document per chapter (1,189), one verse a line, for the regime experiment
(docs/regime.md). Its text is in the public domain (translated 1611; Debian's copyright file for
bible-kjv-text says so); it is read out of Debian's packages:

    apt-get install bible-kjv bible-kjv-text       # version 4.38 (Debian 12 "bookworm")
    python scripts/make_kjv_corpus.py               # deterministic: the same bytes on every run

`bible -l0 "Gen1:1-Rev22:21"` prints every chapter as a line "Book N", a blank line, then one
line per verse, "  V text", unwrapped.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.shipped import shipped_corpus  # noqa: E402

CHAPTERS, VERSES = 1189, 31102  # the KJV's counts: a check that nothing was cut
HEADING = re.compile(r"^(?P<book>[1-3]?\s?[A-Z][A-Za-z ]*?) (?P<chapter>\d+)$")
VERSE = re.compile(r"^\s+(?P<verse>\d+) (?P<text>\S.*)$")


def package_version(name: str) -> str:
    return subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", name], check=True, capture_output=True, text=True
    ).stdout


def chapters(listing: str) -> list[dict]:
    records: list[dict] = []
    for line in listing.splitlines():
        if heading := HEADING.match(line):
            book, chapter = heading["book"], int(heading["chapter"])
            records.append({"id": f"kjv:{book} {chapter}", "book": book, "chapter": chapter,
                            "verses": []})  # fmt: skip
        elif verse := VERSE.match(line):
            if int(verse["verse"]) != len(records[-1]["verses"]) + 1:
                raise SystemExit(f"{records[-1]['id']}: verse {verse['verse']} out of order")
            records[-1]["verses"].append(verse["text"].strip())
        elif line.strip():
            raise SystemExit(f"unexpected line in the listing: {line[:80]!r}")
    return records


def main() -> None:
    version = package_version("bible-kjv-text")
    listing = subprocess.run(
        ["bible", "-m", "8192", "-l0", "Gen1:1-Rev22:21"], check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    records = chapters(listing)
    verses = sum(len(r["verses"]) for r in records)
    if len(records) != CHAPTERS or verses != VERSES:
        raise SystemExit(f"read {len(records)} chapters and {verses} verses, not "
                         f"{CHAPTERS} and {VERSES}")  # fmt: skip
    lines = [
        json.dumps({"id": r["id"], "text": "\n".join(r["verses"]), "book": r["book"],
                    "chapter": r["chapter"], "source": f"Debian bible-kjv-text {version}"})
        + "\n"
        for r in records
    ]  # fmt: skip
    data = zstandard.ZstdCompressor(level=19).compress("".join(lines).encode("utf-8"))
    out = shipped_corpus("kjv")
    out.write_bytes(data)
    print(f"{out}: {len(records)} chapters, {verses} verses, {len(data):,} bytes")


if __name__ == "__main__":
    main()
