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

from pipeline.corpus.documents import Corpus
from pipeline.corpus.records import CorpusOptions, Document

__all__ = ["Corpus", "CorpusOptions", "Document"]
