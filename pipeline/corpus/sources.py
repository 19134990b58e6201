"""One reader per format: each yields a file's records as found (RawRecord) or unusable
(BadRecord), and tracks how far through the file it is for progress."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

from pipeline.corpus.records import (
    UTF8_BOM,
    BadRecord,
    CorpusOptions,
    RawRecord,
    checked,
    decode_utf8,
)
from pipeline.errors import CorpusError
from pipeline.io import open_counted_stream
from pipeline.storage.store import open_input, open_parquet

_BATCH_ROWS = 1024


class Source:
    """One file (or dataset) of a corpus. `records()` yields RawRecords, or BadRecords."""

    def __init__(self, name: str, path: Path | str | None, size: int):
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
        # Once a record of the file had the text field, one without it is a bad record, not a
        # sign of another --text-column.
        text_found = False
        with open_counted_stream(self.path, open_input) as (raw, stream):
            for index, line in enumerate(stream):
                self.fraction = raw.tell() / max(self.size, 1)
                if index == 0:
                    line = line.removeprefix(UTF8_BOM)
                if line.strip():
                    record = checked(self._parse, index, line, options, text_found)
                    text_found = text_found or isinstance(record, RawRecord)
                    yield record
        self.fraction = 1.0

    @staticmethod
    def _parse(index: int, line: bytes, options: CorpusOptions, text_found: bool) -> RawRecord:
        try:
            row = json.loads(decode_utf8(line, index))
        except json.JSONDecodeError as exc:
            raise BadRecord(index, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise BadRecord(index, f"a JSON {type(row).__name__}, not an object")
        text, targets = None, None
        if options.targets != "chat":  # a chat record's text is rendered from its messages
            if options.text_column not in row:
                raise BadRecord(
                    index,
                    f"no field {options.text_column!r} (fields: {', '.join(map(repr, sorted(row))) or 'none'})",
                    advice=None if text_found else _text_field_advice(row, options),
                )
            text = row[options.text_column]
        if (column := options.targets_column) is not None:
            if column not in row:
                raise BadRecord(index, f"no field {column!r} (--targets {options.targets})")
            targets = row[column]
        doc_id = None
        if options.id_column is not None:
            if options.id_column not in row:
                raise BadRecord(index, f"no id field {options.id_column!r}")
            doc_id = row[options.id_column]
        return RawRecord(index, text, doc_id, targets)


def _text_field_advice(row: dict, options: CorpusOptions) -> str:
    """For a file whose first record lacks the text field: the field to name instead, taken to
    be the one with the longest string (an id or a title is shorter than a document)."""
    texts = {k: v for k, v in row.items() if isinstance(v, str) and k != options.id_column}
    if not texts:
        return "pass --text-column with the field that holds the text"
    longest = max(texts, key=lambda name: len(texts[name]))
    return f"pass --text-column {shown_name(longest)} if that field holds the text"


def shown_name(name: str) -> str:
    """A field or column name as a message shows it: as a shell would take it, or where that
    would break the message's one line (a newline in the name), escaped as Python writes it."""
    return shlex.quote(name) if name.isprintable() else repr(name)


class TextFileSource(Source):
    def records(self, options: CorpusOptions) -> Iterator[RawRecord | BadRecord]:
        if options.targets != "all":
            raise CorpusError(
                f"{self.path}: a text file has no fields to name targets in: --targets "
                f"{options.targets} reads JSON lines, Parquet or a dataset"
            )
        with open_counted_stream(self.path, open_input) as (raw, stream):
            if options.text_split == "file":
                yield RawRecord(0, stream.read().removeprefix(UTF8_BOM))
            else:
                for index, line in enumerate(stream):
                    self.fraction = raw.tell() / max(self.size, 1)
                    line = line.rstrip(b"\n").removesuffix(b"\r")
                    if index == 0:
                        line = line.removeprefix(UTF8_BOM)
                    if line.strip():
                        yield RawRecord(index, line)
        self.fraction = 1.0


def _table_columns(options: CorpusOptions, names: list[str], where: str) -> list[str]:
    wanted = [] if options.targets == "chat" else [options.text_column]
    wanted += [options.targets_column] if options.targets_column else []
    wanted += [options.id_column] if options.id_column else []
    missing = [c for c in wanted if c not in names]
    if missing:
        raise no_column(where, missing[0], names)
    return wanted


def no_column(where: str, name: str, names) -> CorpusError:
    return CorpusError(
        f"{where}: no column {name!r}; the columns are: {', '.join(map(shown_name, names))}"
    )


def _batch_records(batch: dict[str, list], first_row: int, options: CorpusOptions):
    size = len(next(iter(batch.values())))
    texts = [None] * size if options.targets == "chat" else batch[options.text_column]
    targets = batch[options.targets_column] if options.targets_column else [None] * size
    ids = batch[options.id_column] if options.id_column else [None] * size
    for offset, (text, doc_id, target) in enumerate(zip(texts, ids, targets, strict=True)):
        yield RawRecord(first_row + offset, text, doc_id, target)


class ParquetSource(Source):
    def records(self, options: CorpusOptions) -> Iterator[RawRecord | BadRecord]:
        import pyarrow as pa

        try:
            parquet = open_parquet(self.path)
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
            size = len(batch[columns[0]])
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
            wanted = _table_columns(options, list(values), f"hub dataset {self.hub_name}")
            yield from _batch_records({c: [values[c]] for c in wanted}, row, options)
