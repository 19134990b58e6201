"""Write the shipped novels corpus (pipeline/assets/corpus/novels-chapters.jsonl.zst): Jane
Austen's six novels and Herman Melville's Moby-Dick, one document per chapter (405), one
paragraph a line, for the regime experiment's GPU form (docs/regime.md, "At GPU scale"). The
texts are in the public domain (published 1811-1818 and 1851; Project Gutenberg's transcriptions,
which Debian's packages carry as R data); they are read out of two Debian 12 packages without
installing R:

    python scripts/make_novels_corpus.py    # apt-get download, then deterministic: the same bytes

r-cran-janeaustenr 1.0.0-1 holds each novel as a character vector, one line of the printed
text an element; r-cran-tokenizers 0.3.0-1 holds Moby-Dick as one string with its Gutenberg
header and licence. Both are R's lazy-load data (data/Rdata.rdx, a gzipped index of offsets into
data/Rdata.rdb, each object zlib-compressed in R's XDR serialization), read by the few lines of
`Unserializer` below. Front matter (title pages, Austen's advertisement, Melville's etymology and
extracts) and end matter (an edition's note, Gutenberg's licence) are left out; italics markers
(`_word_`), scene-break asterisks and bracketed editorial notes are dropped.
"""

from __future__ import annotations

import gzip
import json
import re
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.shipped import shipped_corpus  # noqa: E402

PACKAGES = {"r-cran-janeaustenr": "1.0.0-1", "r-cran-tokenizers": "0.3.0-1"}
# Each work: the package and R object that hold it, its author, and its chapter count (a check
# that nothing was cut).
WORKS = {
    "sense-and-sensibility": ("r-cran-janeaustenr", "sensesensibility", "Jane Austen", 50),
    "pride-and-prejudice": ("r-cran-janeaustenr", "prideprejudice", "Jane Austen", 61),
    "mansfield-park": ("r-cran-janeaustenr", "mansfieldpark", "Jane Austen", 48),
    "emma": ("r-cran-janeaustenr", "emma", "Jane Austen", 55),
    "northanger-abbey": ("r-cran-janeaustenr", "northangerabbey", "Jane Austen", 31),
    "persuasion": ("r-cran-janeaustenr", "persuasion", "Jane Austen", 24),
    "moby-dick": ("r-cran-tokenizers", "mobydick", "Herman Melville", 136),
}
HEADING = re.compile(r"^(?:CHAPTER|Chapter) (?:[0-9]+|[IVXLC]+)\b.*$|^Epilogue$")
ENDS = {"THE END", "FINIS", "Finis", "A NOTE ON THE TEXT",
        "End of Project Gutenberg's Moby Dick; or The Whale, by Herman Melville"}  # fmt: skip
DROPPED = re.compile(r"^(?:VOLUME [IV]+|\*+|\[.*\])$")  # volume titles, breaks, editors' notes
PARAGRAPHS = 12_431  # all works' paragraphs: a second check on the parsing


class Unserializer:
    """R's XDR serialization (format 2 or 3), only the types R's data files of character vectors
    and their lazy-load index use: vectors, pairlists (attributes), symbols and references."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise SystemExit("not R's XDR serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.pos += 8  # the writer's and the minimal reader's R versions
        if version == 3:
            self.pos += 4 + self.int()  # the native encoding's name

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def read(self):
        flags = self.int()
        kind, has_attributes, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:  # NULL
            return None
        if kind == 255:  # a reference to an earlier symbol
            return self.refs[(flags >> 8 or self.int()) - 1]
        if kind == 1:  # a symbol: its name
            self.refs.append(self.read())
            return self.refs[-1]
        if kind == 9:  # a string: latin-1 where its flags say so, else UTF-8
            length = self.int()
            if length == -1:
                return None
            raw = self.data[self.pos : self.pos + length]
            self.pos += length
            return raw.decode("latin-1" if flags & (1 << 14) else "utf-8")
        if kind == 2:  # a pairlist: a dict of tag -> value
            if has_attributes:
                self.read()
            tag = self.read() if has_tag else None
            head = {tag: self.read()}
            return head | (self.read() or {})
        if kind in (10, 13):  # logical, integer
            length = self.int()
            values = list(struct.unpack_from(f">{length}i", self.data, self.pos))
            self.pos += 4 * length
        elif kind in (16, 19):  # character, list
            values = [self.read() for _ in range(self.int())]
        else:
            raise SystemExit(f"R type {kind} is not one this reader knows")
        attributes = self.read() if has_attributes else {}
        names = attributes.get("names")
        return dict(zip(names, values, strict=True)) if kind == 19 and names else values


def lazy_load_data(folder: Path) -> dict:
    """Every object of an R package's data/Rdata.rdb, by name."""
    index = Unserializer(gzip.decompress((folder / "Rdata.rdx").read_bytes())).read()
    database = (folder / "Rdata.rdb").read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        # Each object: its uncompressed length (4 bytes), then a zlib stream.
        objects[name] = Unserializer(zlib.decompress(database[offset + 4 : offset + length])).read()
    return objects


def chapters(lines: list[str]) -> list[list[str]]:
    """The paragraphs of each chapter: lines from each heading to the next (the last chapter to
    its end line), paragraphs split at blank lines and their printed lines joined."""
    found, paragraph = [], []
    for raw in [*lines, ""]:
        line = raw.strip()
        if found and line and line not in ENDS and not HEADING.match(line):
            if not DROPPED.match(line):
                paragraph.append(line.replace("_", ""))
                continue
        if paragraph:  # a blank, dropped, heading or end line closes a paragraph
            found[-1].append(" ".join(paragraph))
            paragraph = []
        if line in ENDS and found:
            break
        if HEADING.match(line):
            found.append([])
    return found


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        subprocess.run(["apt-get", "download", *(f"{p}={v}" for p, v in PACKAGES.items())],
                       cwd=folder, check=True)  # fmt: skip
        data = {}
        for deb in sorted(folder.glob("*.deb")):
            package = deb.name.split("_")[0]
            subprocess.run(["dpkg-deb", "-x", str(deb), str(folder / package)], check=True)
            site = folder / package / "usr" / "lib" / "R" / "site-library"
            data[package] = lazy_load_data(site / package.removeprefix("r-cran-") / "data")
    records = []
    for work, (package, name, author, expected) in WORKS.items():
        lines = data[package][name]
        if len(lines) == 1:  # Moby-Dick: the whole file, one string
            lines = lines[0].lstrip("\ufeff").split("\r\n")
        found = chapters(lines)
        if len(found) != expected or not all(found):
            raise SystemExit(f"{work}: read {len(found)} chapters, not {expected} (or one empty)")
        for number, paragraphs in enumerate(found, 1):
            records.append({
                "id": f"{work}:{number}", "text": "\n".join(paragraphs), "work": work,
                "author": author, "chapter": number,
                "source": f"Debian {package} {PACKAGES[package]}",
            })  # fmt: skip
    paragraphs = sum(r["text"].count("\n") + 1 for r in records)
    if paragraphs != PARAGRAPHS:
        raise SystemExit(f"read {paragraphs} paragraphs, not {PARAGRAPHS}")
    lines = "".join(json.dumps(r) + "\n" for r in records)
    out = shipped_corpus("novels")
    out.write_bytes(zstandard.ZstdCompressor(level=19).compress(lines.encode("utf-8")))
    characters = sum(len(r["text"]) for r in records)
    print(f"{out}: {len(records)} chapters, {paragraphs:,} paragraphs, {characters:,} characters, "
          f"{out.stat().st_size:,} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
