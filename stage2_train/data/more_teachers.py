"""Several teachers' caches of one corpus in one run (--more-caches, docs/several-teachers.md).

The caches are read in step: the stream's plan (its items, reads and shuffles) is the first
cache's, and each read of the first cache's shard takes the same rows of the same shard of every
other cache, checked to be the same documents. Each cache is read once and a read's rows are
held once per cache, so memory per rank grows with the number of caches, not with the corpus.
The student tokenizes each text once; each teacher's tokens are aligned to the student's on
their own (pipeline.teacher_loss), and the per-token losses combined by the run's rule: under
`source`, each document's teacher is the one --source-teachers names for its corpus source, which
its id names (stage 1 calls a document `<source>:<record>` unless the corpus has --id-column).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.cache.manifest import CacheManifest
from pipeline.cache.rows import (
    check_extra_columns,
    check_rows,
    list_column,
    rows_index,
    token_values,
)
from pipeline.cache.schema import (
    DOC_ID,
    LOSS,
    TEXT,
    TEXT_SHA256,
    TOKEN_END,
    TOKEN_START,
    iter_shard_batches,
)
from pipeline.errors import CacheError, ConfigError
from pipeline.io import fingerprint
from pipeline.teacher_options import source_teachers
from stage2_train.data.plan import TeacherCache, cache_fingerprint

COLUMNS = [DOC_ID, TEXT, TEXT_SHA256, TOKEN_START, TOKEN_END, LOSS]


@dataclass(frozen=True)
class TeacherTokens:
    """One teacher's tokens of a read's documents, rows in the read's order, concatenated."""

    start: np.ndarray
    end: np.ndarray
    loss: np.ndarray
    lengths: np.ndarray  # tokens per document
    alignment: str
    columns: dict[str, np.ndarray]  # a distillation's cache columns, per token (else empty)


def teacher_caches(
    first: str | Path, manifest: CacheManifest, more: dict[str | Path, CacheManifest], align
) -> tuple[TeacherCache, ...]:
    """The `more` caches, each refused in one line unless it scored the first cache's corpus
    (the same files, sizes and reading options) into the same shards (the same rows per shard);
    `align(tokenizer)` gives the alignment of a cache with that tokenizer record."""
    caches = []
    for location, other in more.items():
        # what was read and how first, then the shard layout, and only then what the reading
        # gave: a layout or reading option changes the content's hash, which names no cause
        problem = corpus_difference(manifest.corpus, other.corpus, READ_OUTCOME[1:])
        if problem is None and len(other.shards) != len(manifest.shards):
            problem = f"{len(other.shards)} shards, not {len(manifest.shards)}"
        for mine, theirs in zip(manifest.shards, other.shards, strict=False):
            if problem is None and (mine.rows, mine.index) != (theirs.rows, theirs.index):
                problem = f"{theirs.file} holds {theirs.rows} documents, not {mine.rows}"
        problem = problem or corpus_difference(manifest.corpus, other.corpus, READ_OUTCOME[:1])
        if problem is not None:
            raise CacheError(
                f"--more-caches {location} is not a cache of --cache {first}'s corpus in the same "
                f"shards ({problem}): score the same --corpus, read alike, with the same "
                "--docs-per-shard"
            )
        fingerprint_of, alignment = cache_fingerprint(other), align(other.tokenizer)
        caches.append(TeacherCache(location, tuple(other.shards), fingerprint_of, alignment,
                                   other.settings.sample_head_size))  # fmt: skip
    return tuple(caches)


def teacher_settings(data, guidance, manifest: CacheManifest, more: dict, align) -> dict:
    """DataPlan's settings for a run's other teachers: `data` names the caches (--cache,
    --more-caches), `guidance` how their losses combine (--combine-teachers, --source-teachers),
    stage 2's sections or `vocagno analyze selection`'s options for both; `more`: --more-caches'
    manifests by location."""
    combine = guidance.combine_teachers
    chosen = source_teachers(data.cache, data.more_caches, combine, guidance.source_teachers)
    return {
        "more_caches": teacher_caches(data.cache, manifest, more, align),
        "combine_teachers": combine,
        "source_teachers": source_indices(chosen, manifest, [data.cache, *more]),
        "head_size": manifest.settings.sample_head_size,
    }


def source_indices(chosen: dict[str, str], manifest: CacheManifest, caches: list) -> dict:
    """--source-teachers as corpus source -> index of its teacher's cache in `caches`, refused in
    one line unless it names every source of the corpus and the documents' ids name theirs."""
    if not chosen:
        return {}
    corpus = manifest.corpus
    if corpus.get("id_column"):
        raise ConfigError(
            f"--combine-teachers source reads each document's source from its id, and the "
            f"corpus's ids come from its {corpus['id_column']!r} column: use min or mean"
        )
    names = [source["name"] for source in corpus.get("sources", [])]
    if sorted(chosen) != sorted(names):
        raise ConfigError(
            f"--source-teachers names {', '.join(sorted(chosen))}: it must name a teacher for "
            f"each of the corpus's sources, {', '.join(names)}"
        )
    locations = [str(location) for location in caches]
    return {name: locations.index(chosen[name]) for name in names}


def document_teachers(doc_ids: list[str], teachers: dict[str, int]) -> np.ndarray:
    """Per document, the index of its source's teacher (`teachers`: source_indices')."""
    chosen = [teachers.get(doc_id.rpartition(":")[0], -1) for doc_id in doc_ids]
    if -1 in chosen:
        doc_id = doc_ids[chosen.index(-1)]
        raise CacheError(
            f"document {doc_id!r} names no source of the corpus (stage 1 names a document "
            "<source>:<record>): --combine-teachers source cannot choose its teacher"
        )
    return np.asarray(chosen, dtype=np.int64)


# What a corpus record holds of what reading it gave (the documents' hash, their counts), beside
# the files and options that were read.
READ_OUTCOME = ("content_sha256", "documents", "skipped")


def corpus_difference(first: dict, other: dict, outcome: tuple[str, ...]) -> str | None:
    """The first way two caches' corpus records differ, in words (None: the same corpus): their
    files, then their reading options, then the `outcome` keys (of READ_OUTCOME) only."""
    files = {s["name"]: s["bytes"] for s in first.get("sources", [])}
    for source in other.get("sources", []):
        size = files.pop(source["name"], None)
        if size is None:
            return f"it reads {source['name']}, which --cache does not"
        if size != source["bytes"]:
            return f"its {source['name']} has {source['bytes']} bytes, --cache's {size}"
    if files:
        return f"it does not read {next(iter(files))}"
    options = sorted((set(first) | set(other)) - {"sources", *READ_OUTCOME})
    for key in [*options, *outcome]:
        theirs, ours = other.get(key), first.get(key)
        if theirs == ours:
            continue
        if key == "targets":  # recorded only where not every character is one
            said = [(v or {}).get("mode", "all") for v in (theirs, ours)]
            return f"it read the corpus with --targets {said[0]}, --cache with --targets {said[1]}"
        return f"its corpus {key} is {theirs!r}, --cache's {ours!r}"
    return None


def run_cache_fingerprint(manifest: CacheManifest, more: tuple[TeacherCache, ...]) -> str:
    """What a checkpoint's data came from: the cache's fingerprint, or with --more-caches that
    of every cache in order."""
    first = cache_fingerprint(manifest)
    return fingerprint([first, *(cache.fingerprint for cache in more)]) if more else first


class RowFeed:
    """One other cache's shard, handed out in runs of rows of any length (the caches' Parquet
    batches need not line up with the first cache's)."""

    def __init__(
        self,
        path: Path,
        alignment: str,
        batch_rows: int,
        columns: tuple[str, ...] = (),
        head_size: int | None = None,
    ):
        """`columns`: the distillation's cache columns, read beside the loss path's and checked
        as `cache verify` checks them (`head_size`: the cache's teacher's outputs)."""
        self.path, self.alignment, self.columns = path, alignment, columns
        self.head_size = head_size
        self._batches = iter_shard_batches(
            path, COLUMNS + list(columns), batch_rows, use_threads=False
        )
        self._pending = None

    def take(self, rows: int) -> pa.RecordBatch:
        """The next `rows` rows."""
        parts, have = [], 0
        while have < rows:
            if self._pending is None or self._pending.num_rows == 0:
                self._pending = next(self._batches, None)
                if self._pending is None:
                    raise CacheError(f"shard {self.path} has fewer rows than the first cache's")
            part = self._pending.slice(0, rows - have)
            self._pending = self._pending.slice(part.num_rows)
            parts.append(part)
            have += part.num_rows
        return pa.Table.from_batches(parts).combine_chunks().to_batches()[0]

    def tokens(
        self, first: pa.RecordBatch, batch: pa.RecordBatch, mine: np.ndarray, order: np.ndarray,
        first_row: int,
    ) -> TeacherTokens:  # fmt: skip
        """This teacher's tokens of rows `mine` of a read (`first`: the first cache's rows, whose
        documents these must be), put in `order` as the first cache's are."""
        rows = first_row + mine
        own = batch if mine.size == batch.num_rows else batch.take(pa.array(mine))
        for name in (DOC_ID, TEXT_SHA256):
            theirs, expected = own.column(name).to_pylist(), first.column(name).to_pylist()
            wrong = next(
                (i for i, (a, b) in enumerate(zip(theirs, expected, strict=True)) if a != b), None
            )
            if wrong is not None:
                raise CacheError(
                    f"shard {self.path} row {rows[wrong]} is document {theirs[wrong]!r} where "
                    f"the first cache has {expected[wrong]!r} ({name}): the caches must hold the "
                    "same documents in the same order"
                )
        checked = check_rows(self.path, own, rows)
        decoded = (
            check_extra_columns(self.path, own, rows, checked.lengths, self.head_size)
            if self.columns
            else {}
        )
        index = rows_index(checked.lengths, order)
        loss = list_column(own, LOSS, np.float32)[0]
        return TeacherTokens(
            checked.token_start[index],
            checked.token_end[index],
            loss[index],
            checked.lengths[order],
            self.alignment,
            {
                name: (decoded[name] if name in decoded else token_values(own, name))[index]
                for name in self.columns
            },
        )
