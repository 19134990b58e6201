"""Deterministic work units: unit k holds documents k*D .. k*D+D-1 of the corpus stream and
always becomes shard k, whichever worker scores it and however often the job is restarted.

A skipped record belongs to the unit that is open when it is read (a unit closes only when the
next unit's first document arrives), so every skip lands in exactly one unit. Each unit carries
a content hash of its document ids, text hashes, target spans and skips: a rerun can prove that
a finished shard was made from the same documents the corpus holds now.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pipeline.cache.manifest import SkippedDocument
from pipeline.corpus import Document
from pipeline.io import sha256_text


@dataclass(frozen=True)
class WorkUnit:
    index: int
    doc_ids: list[str]
    texts: list[str]
    text_sha256: list[str]
    skipped: list[SkippedDocument]
    content_sha256: str
    corpus_fraction: float  # share of the corpus read when the unit closed
    target_spans: list = field(default_factory=list)  # per document: Spans, or None (all)

    def __len__(self) -> int:
        return len(self.doc_ids)


class _OpenUnit:
    def __init__(self, index: int):
        self.index = index
        self.doc_ids: list[str] = []
        self.texts: list[str] = []
        self.text_sha256: list[str] = []
        self.skipped: list[SkippedDocument] = []
        self.target_spans: list = []
        self.digest = hashlib.sha256()

    def add(self, item: Document | SkippedDocument) -> None:
        if isinstance(item, Document):
            text_sha256 = sha256_text(item.text)
            self.doc_ids.append(item.doc_id)
            self.texts.append(item.text)
            self.text_sha256.append(text_sha256)
            self.target_spans.append(item.target_spans)
            line = f"D\t{item.doc_id}\t{text_sha256}\n"
            if item.target_spans is not None:  # other targets: another unit (no spans: as ever)
                line = f"{line[:-1]}\t{json.dumps(item.target_spans)}\n"
        else:
            self.skipped.append(item)
            line = f"S\t{item.source}\t{item.record}\t{item.doc_id}\t{item.reason}\n"
        self.digest.update(line.encode("utf-8"))

    def close(self, corpus_fraction: float) -> WorkUnit:
        return WorkUnit(
            self.index,
            self.doc_ids,
            self.texts,
            self.text_sha256,
            self.skipped,
            self.digest.hexdigest(),
            corpus_fraction,
            self.target_spans,
        )


def plan_units(
    items: Iterable[Document | SkippedDocument],
    docs_per_shard: int,
    fraction_read: Callable[[], float] = lambda: 0.0,
) -> Iterator[WorkUnit]:
    """Cut the corpus stream into units of `docs_per_shard` documents (the last may be short).

    A corpus with skips but no documents yields one unit with no documents, so the skips are
    still reported.
    """
    if docs_per_shard < 1:
        raise ValueError(f"docs_per_shard must be positive, not {docs_per_shard}")
    unit = _OpenUnit(0)
    for item in items:
        if isinstance(item, Document) and len(unit.doc_ids) == docs_per_shard:
            yield unit.close(fraction_read())
            unit = _OpenUnit(unit.index + 1)
        unit.add(item)
    if unit.doc_ids or unit.skipped:
        yield unit.close(fraction_read())
