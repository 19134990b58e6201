"""Stream a corpus's documents, one record at a time: corpora are far larger than memory.

A corpus spec is one of (the format follows the file name; `.zst`/`.zstd` means zstd-compressed):
  - JSON lines: `*.jsonl`, `*.ndjson`, `*.json` (one object per line; blank lines are not records),
  - Parquet: `*.parquet` (streamed row group by row group),
  - plain text: `*.txt`, `*.md`; `text_split="file"` makes each file one document,
    `text_split="line"` makes each non-blank line one document (without its line break),
  - a folder written by `datasets`' `save_to_disk` (a `Dataset`, or a `DatasetDict` and a split),
  - any other folder or a glob pattern: every supported file below it, in sorted path order,
  - `hf:NAME`: a dataset on the Hugging Face hub, streamed (only where a hub is reachable).

Document ids come from `id_column` when given (duplicates are an error); otherwise they are
`<source>:<record>`, the file's path relative to the corpus root and the 0-based record index
(the line index for JSON lines and text lines, the row for tables), unique by construction.
Finding duplicates among given ids keeps every id seen in memory (about 100 bytes each).

A bad record (null, empty or whitespace-only text, invalid UTF-8, invalid JSON, a missing field,
a null or duplicate id) raises a `CorpusError` naming the file and record, or with
`on_bad_record="skip"` comes out as a `SkippedDocument` with its reason, so it is counted and
reported, never dropped silently. A missing text column in a table is always an error.

The corpus description (`describe()`) lists every file with its size: enough to refuse a
different corpus at startup without reading hundreds of GB. Content changes of equal size are
caught by a content hash that stage 1 computes over the documents as it streams them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zstandard

from pipeline.choices import ON_BAD_RECORD, TEXT_SPLITS, OnBadRecord, TextSplit
from pipeline.errors import CorpusError
from pipeline.io import is_zstd
from pipeline.manifest import SkippedDocument

HUB_PREFIX = "hf:"
JSON_LINES = ("*.jsonl", "*.ndjson", "*.json")
PARQUET = ("*.parquet",)
PLAIN_TEXT = ("*.txt", "*.md")
_COMPRESSED = (".zst", ".zstd")
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class CorpusOptions:
    text_column: str = "text"
    id_column: str | None = None
    split: str = "train"
    text_split: TextSplit = "file"
    on_bad_record: OnBadRecord = "error"

    def __post_init__(self) -> None:
        if not self.text_column:
            raise ValueError("text_column must not be empty")
        if self.text_split not in TEXT_SPLITS:
            raise ValueError(f"text_split must be one of {TEXT_SPLITS}, not {self.text_split!r}")
        if self.on_bad_record not in ON_BAD_RECORD:
            raise ValueError(
                f"on_bad_record must be one of {ON_BAD_RECORD}, not {self.on_bad_record!r}"
            )


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str
    source: str
    record: int


class BadRecord(Exception):
    """One unusable record; the corpus turns it into an error or a skip.

    Sources yield it (a raise would end their generator); value checks raise it.
    """

    def __init__(self, record: int, reason: str, doc_id: str | None = None):
        super().__init__(reason)
        self.record = record
        self.reason = reason
        self.doc_id = doc_id


@dataclass(frozen=True)
class RawRecord:
    """What a source found at one record: values not yet checked."""

    record: int
    text: Any
    doc_id: Any = None


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    base = (
        name[: -len(s)] if (s := next((c for c in _COMPRESSED if name.endswith(c)), "")) else name
    )
    return any(fnmatch.fnmatch(base, p) for p in patterns)


def _is_supported(path: Path) -> bool:
    return _matches(path.name, JSON_LINES + PARQUET + PLAIN_TEXT)


def _is_saved_dataset(path: Path) -> bool:
    if (path / "dataset_dict.json").exists():
        return True
    return (path / "state.json").exists() and (path / "dataset_info.json").exists()


def _decode(value: bytes, record: int) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRecord(record, f"invalid UTF-8 at byte {exc.start}") from None


def _checked(parse, *args) -> RawRecord | BadRecord:
    try:
        return parse(*args)
    except BadRecord as bad:
        return bad


@contextlib.contextmanager
def _open_counted(path: Path) -> Iterator[tuple[IO[bytes], IO[bytes]]]:
    """(raw file, decoded stream): the raw file's position measures progress through the file."""
    with open(path, "rb") as raw:
        if is_zstd(path):
            decompressor = zstandard.ZstdDecompressor()
            with decompressor.stream_reader(raw, read_across_frames=True) as reader:
                yield raw, io.BufferedReader(reader, buffer_size=1 << 20)
        else:
            yield raw, raw


class Source:
    """One file (or dataset) of a corpus. `records()` yields RawRecords, or BadRecords."""

    def __init__(self, name: str, path: Path | None, size: int):
        self.name = name
        self.path = path
        self.size = size
        self.fraction = 0.0  # of this source read so far

    def records(self, options: CorpusOptions) -> Iterator[RawRecord | BadRecord]:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": self.name, "bytes": self.size}


class JsonLinesSource(Source):
    def records(self, options: CorpusOptions) -> Iterator[RawRecord | BadRecord]:
        with _open_counted(self.path) as (raw, stream):
            for index, line in enumerate(stream):
                self.fraction = raw.tell() / max(self.size, 1)
                if line.strip():
                    yield _checked(self._parse, index, line, options)
        self.fraction = 1.0

    @staticmethod
    def _parse(index: int, line: bytes, options: CorpusOptions) -> RawRecord:
        try:
            row = json.loads(_decode(line, index))
        except json.JSONDecodeError as exc:
            raise BadRecord(index, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise BadRecord(index, f"a JSON {type(row).__name__}, not an object")
        if options.text_column not in row:
            raise BadRecord(
                index,
                f"no field {options.text_column!r} (fields: {', '.join(sorted(row)) or 'none'})",
            )
        doc_id = None
        if options.id_column is not None:
            if options.id_column not in row:
                raise BadRecord(index, f"no id field {options.id_column!r}")
            doc_id = row[options.id_column]
        return RawRecord(index, row[options.text_column], doc_id)


class TextFileSource(Source):
    def records(self, options: CorpusOptions) -> Iterator[RawRecord | BadRecord]:
        with _open_counted(self.path) as (raw, stream):
            if options.text_split == "file":
                yield RawRecord(0, stream.read())
            else:
                for index, line in enumerate(stream):
                    self.fraction = raw.tell() / max(self.size, 1)
                    line = line.rstrip(b"\n").removesuffix(b"\r")
                    if line.strip():
                        yield RawRecord(index, line)
        self.fraction = 1.0


def _table_columns(options: CorpusOptions, names: list[str], where: str) -> list[str]:
    wanted = [options.text_column] + ([options.id_column] if options.id_column else [])
    missing = [c for c in wanted if c not in names]
    if missing:
        raise CorpusError(f"{where}: no column {missing[0]!r}; the columns are: {', '.join(names)}")
    return wanted


def _batch_records(batch: dict[str, list], first_row: int, options: CorpusOptions):
    texts = batch[options.text_column]
    ids = batch[options.id_column] if options.id_column else [None] * len(texts)
    for offset, (text, doc_id) in enumerate(zip(texts, ids, strict=True)):
        yield RawRecord(first_row + offset, text, doc_id)


class ParquetSource(Source):
    def records(self, options: CorpusOptions) -> Iterator[RawRecord | BadRecord]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(self.path)
        except Exception as exc:
            raise CorpusError(f"{self.path} is not a readable Parquet file: {exc}") from exc
        columns = _table_columns(options, parquet.schema_arrow.names, str(self.path))
        total = max(parquet.metadata.num_rows, 1)
        row = 0
        for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            # Arrow does not check UTF-8 when reading Parquet; reading as bytes lets us check it.
            as_bytes = {
                name: batch.column(name).cast(pa.large_binary())
                if pa.types.is_string(batch.column(name).type)
                or pa.types.is_large_string(batch.column(name).type)
                else batch.column(name)
                for name in columns
            }
            self.fraction = (row + batch.num_rows) / total
            yield from _batch_records(
                {name: col.to_pylist() for name, col in as_bytes.items()}, row, options
            )
            row += batch.num_rows
        self.fraction = 1.0


class SavedDatasetSource(Source):
    """A `datasets` folder: memory-mapped Arrow files, iterated in batches (never loaded whole)."""

    def records(self, options: CorpusOptions) -> Iterator[RawRecord | BadRecord]:
        dataset = _load_saved_dataset(self.path, options.split)
        columns = _table_columns(options, dataset.column_names, str(self.path))
        total = max(len(dataset), 1)
        row = 0
        for batch in dataset.select_columns(columns).iter(batch_size=_BATCH_ROWS):
            size = len(batch[options.text_column])
            self.fraction = (row + size) / total
            yield from _batch_records(batch, row, options)
            row += size
        self.fraction = 1.0


def _load_saved_dataset(path: Path, split: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise CorpusError(f"{path} is not a readable saved dataset: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise CorpusError(f"{path} has no split {split!r}; its splits are: {', '.join(loaded)}")
        return loaded[split]
    return loaded


class HubDatasetSource(Source):
    """A hub dataset, streamed; needs network access to the hub."""

    def __init__(self, hub_name: str, split: str):
        super().__init__(f"{hub_name}/{split}", None, 0)
        self.hub_name = hub_name
        self.split = split

    def describe(self) -> dict:
        return {"name": self.name, "hub": self.hub_name, "split": self.split}

    def records(self, options: CorpusOptions) -> Iterator[RawRecord | BadRecord]:
        import datasets

        try:
            stream = datasets.load_dataset(self.hub_name, split=self.split, streaming=True)
        except Exception as exc:
            raise CorpusError(f"cannot stream hub dataset {self.hub_name!r}: {exc}") from exc
        if stream.column_names is not None:
            _table_columns(options, stream.column_names, f"hub dataset {self.hub_name}")
        for row, values in enumerate(stream):
            if options.text_column not in values:
                raise CorpusError(
                    f"hub dataset {self.hub_name}: no column {options.text_column!r}; "
                    f"the columns are: {', '.join(values)}"
                )
            doc_id = values.get(options.id_column) if options.id_column else None
            yield RawRecord(row, values[options.text_column], doc_id)


def _file_source(path: Path, name: str) -> Source:
    size = path.stat().st_size
    if _matches(path.name, JSON_LINES):
        return JsonLinesSource(name, path, size)
    if _matches(path.name, PARQUET):
        return ParquetSource(name, path, size)
    if _matches(path.name, PLAIN_TEXT):
        return TextFileSource(name, path, size)
    raise CorpusError(
        f"{path}: unsupported file type; expected JSON lines ({', '.join(JSON_LINES)}), "
        f"Parquet ({', '.join(PARQUET)}) or text ({', '.join(PLAIN_TEXT)}), optionally .zst"
    )


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def resolve_sources(spec: str, split: str = "train") -> tuple[str, list[Source]]:
    """(format, sources) for a corpus spec; raises CorpusError if there is nothing to read."""
    if spec.startswith(HUB_PREFIX):
        return "hub", [HubDatasetSource(spec[len(HUB_PREFIX) :], split)]
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        root = _glob_root(spec)
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise CorpusError(f"corpus pattern {spec!r} matches no files")
        return "files", [_file_source(f, f.relative_to(root).as_posix()) for f in files]
    if not path.exists():
        raise CorpusError(
            f"corpus path {spec!r} does not exist (for a hub dataset, write {HUB_PREFIX}NAME)"
        )
    if path.is_dir() and _is_saved_dataset(path):
        name = path.name if (path / "state.json").exists() else f"{path.name}/{split}"
        return "datasets", [SavedDatasetSource(name, path, _folder_size(path))]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _is_supported(p))
        if not files:
            raise CorpusError(f"corpus folder {path} holds no supported files")
        return "files", [_file_source(f, f.relative_to(path).as_posix()) for f in files]
    return "files", [_file_source(path, path.name)]


def _glob_root(spec: str) -> Path:
    """The folder part of a pattern before its first wildcard: names are relative to it."""
    parts = Path(spec).expanduser().parts
    fixed = []
    for part in parts:
        if any(ch in part for ch in "*?["):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


class Corpus:
    """The documents of a corpus spec, streamed in a fixed order."""

    def __init__(self, spec: str | Path, options: CorpusOptions | None = None):
        self.spec = str(spec)
        self.options = options or CorpusOptions()
        self.format, self.sources = resolve_sources(self.spec, self.options.split)
        self._finished_bytes = 0

    def describe(self) -> dict:
        """What identifies this corpus without reading it: files and sizes, and the options."""
        return {
            "format": self.format,
            "sources": [s.describe() for s in self.sources],
            "text_column": self.options.text_column,
            "id_column": self.options.id_column,
            "split": self.options.split,
            "text_split": self.options.text_split,
            "on_bad_record": self.options.on_bad_record,
        }

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.sources)

    def fraction_read(self) -> float:
        """Share of the corpus (by file size) streamed so far, for progress and ETA."""
        total = self.total_bytes
        if total == 0:
            return 0.0
        return min(1.0, sum(s.size * s.fraction for s in self.sources) / total)

    def __iter__(self) -> Iterator[Document | SkippedDocument]:
        """Documents in corpus order; bad records raise CorpusError or come out as skips."""
        seen_ids: dict[str, tuple[str, int]] = {}
        for source in self.sources:
            for raw in source.records(self.options):
                try:
                    if isinstance(raw, BadRecord):
                        raise raw
                    yield self._document(source, raw, seen_ids)
                except BadRecord as bad:
                    yield self._bad(source, bad)

    def _document(
        self, source: Source, raw: RawRecord, seen_ids: dict[str, tuple[str, int]]
    ) -> Document:
        if self.options.id_column is None:
            doc_id = f"{source.name}:{raw.record}"
        else:
            doc_id = self._given_id(source, raw, seen_ids)
        text = raw.text
        if isinstance(text, bytes):
            try:
                text = _decode(text, raw.record)
            except BadRecord as bad:
                bad.doc_id = doc_id
                raise
        if text is None:
            raise BadRecord(raw.record, "null text", doc_id)
        if not isinstance(text, str):
            raise BadRecord(raw.record, f"text is a {type(text).__name__}, not a string", doc_id)
        if not text.strip():
            raise BadRecord(raw.record, "empty or whitespace-only text", doc_id)
        return Document(doc_id=doc_id, text=text, source=source.name, record=raw.record)

    def _given_id(
        self, source: Source, raw: RawRecord, seen_ids: dict[str, tuple[str, int]]
    ) -> str:
        value = raw.doc_id
        if isinstance(value, bytes):
            value = _decode(value, raw.record)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise BadRecord(raw.record, f"null or empty id in {self.options.id_column!r}")
        doc_id = str(value)
        first = seen_ids.setdefault(doc_id, (source.name, raw.record))
        if first != (source.name, raw.record):
            raise BadRecord(
                raw.record,
                f"duplicate document id {doc_id!r} (first at {first[0]} record {first[1]})",
                doc_id,
            )
        return doc_id

    def _bad(self, source: Source, bad: BadRecord) -> SkippedDocument:
        if self.options.on_bad_record == "error":
            raise CorpusError(
                f"{source.path or source.name}: record {bad.record}: {bad.reason} "
                "(pass --on-bad-record skip to skip and list such records)"
            )
        return SkippedDocument(
            source=source.name, record=bad.record, doc_id=bad.doc_id, reason=bad.reason
        )
