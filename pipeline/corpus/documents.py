"""The documents of a corpus in a fixed order: ids given or derived, values checked, and every bad
record an error or a listed skip."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pipeline.cache.manifest import SkippedDocument
from pipeline.choices import OWN_CHAT_TEMPLATES
from pipeline.corpus.own_template import OwnTemplate
from pipeline.corpus.records import (
    BadRecord,
    CorpusOptions,
    Document,
    RawRecord,
    decode_utf8,
    surrogate_problem,
)
from pipeline.corpus.resolve import corpus_root, resolve_sources
from pipeline.corpus.sources import Source
from pipeline.corpus.targets import (
    TEMPLATES,
    BadTargets,
    checked_spans,
    named_template_identity,
    render_chat,
    targets_identity,
)
from pipeline.errors import CorpusError


class Corpus:
    """The documents of a corpus spec, streamed in a fixed order."""

    def __init__(
        self,
        spec: str | Path,
        options: CorpusOptions | None = None,
        own_template: OwnTemplate | None = None,
    ):
        """`own_template`: the tokenizer's template that `chat_template` teacher or student
        names (pipeline.corpus.own_template), which the caller loads: it knows the tokenizers."""
        self.spec = str(spec)
        self.options = options or CorpusOptions()
        own = self.options.targets == "chat" and self.options.chat_template in OWN_CHAT_TEMPLATES
        if own != (own_template is not None):
            raise ValueError(
                f"chat_template {self.options.chat_template!r} with targets "
                f"{self.options.targets!r} {'needs' if own else 'takes no'} own_template"
            )
        self.own_template = own_template
        self.format, self.sources = resolve_sources(self.spec, self.options.split)
        self.root = corpus_root(self.spec)  # what it reads, at or below
        self._records_read = 0

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
        } | self.targets_description() | self.slice_description()

    def targets_description(self) -> dict:
        """How the targets are read, only where not every character is one: a corpus read
        with all targets keeps the description (and the caches' identity) it always had."""
        options = self.options
        if options.targets == "all":
            return {}
        identity = targets_identity(options.targets, options.targets_column)
        if self.own_template is not None:
            identity["template"] = self.own_template.describe()
        elif options.targets == "chat":
            identity["template"] = named_template_identity(options.chat_template)
        return {"targets": identity}

    def slice_description(self) -> dict:
        """A slice (--max-docs) is part of the identity; the whole corpus keeps the description
        (and the caches' identity) it always had."""
        max_docs = self.options.max_docs
        return {} if max_docs is None else {"max_docs": max_docs}

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.sources)

    def fraction_read(self) -> float:
        """Share of the corpus (by file size; of --max-docs' records) streamed so far, for
        progress and ETA."""
        if self.options.max_docs is not None:
            return self._records_read / self.options.max_docs
        total = self.total_bytes
        if total == 0:
            return 0.0
        return min(1.0, sum(s.size * s.fraction for s in self.sources) / total)

    def __iter__(self) -> Iterator[Document | SkippedDocument]:
        """Documents in corpus order; bad records raise CorpusError or come out as skips. Under
        --max-docs N, the first N records only."""
        seen_ids: dict[str, tuple[str, int]] = {}
        self._records_read = 0
        for source in self.sources:
            for raw in source.records(self.options):
                if self._records_read == self.options.max_docs:
                    return
                self._records_read += 1
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
        text, spans = raw.text, None
        if self.options.targets == "chat":
            try:
                if self.own_template is not None:
                    text, spans = self.own_template.render(raw.targets)
                else:
                    text, spans = render_chat(raw.targets, TEMPLATES[self.options.chat_template])
            except BadTargets as bad:
                raise BadRecord(raw.record, str(bad), doc_id) from None
        if isinstance(text, bytes):
            try:
                text = decode_utf8(text, raw.record)
            except BadRecord as bad:
                bad.doc_id = doc_id
                raise
        if text is None:
            raise BadRecord(raw.record, "null text", doc_id)
        if not isinstance(text, str):
            kind = type(text).__name__
            article = "an" if kind[0] in "aeiou" else "a"
            raise BadRecord(raw.record, f"text is {article} {kind}, not a string", doc_id)
        if not text.strip():
            raise BadRecord(raw.record, "empty or whitespace-only text", doc_id)
        if problem := surrogate_problem(text, "text"):
            raise BadRecord(raw.record, problem, doc_id)
        if self.options.targets == "spans":
            try:
                spans = checked_spans(raw.targets, len(text))
            except BadTargets as bad:
                raise BadRecord(raw.record, str(bad), doc_id) from None
        return Document(doc_id, text, source.name, raw.record, spans)

    def _given_id(
        self, source: Source, raw: RawRecord, seen_ids: dict[str, tuple[str, int]]
    ) -> str:
        value = raw.doc_id
        if isinstance(value, bytes):
            value = decode_utf8(value, raw.record)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise BadRecord(raw.record, f"null or empty id in {self.options.id_column!r}")
        doc_id = str(value)
        if problem := surrogate_problem(doc_id, "id"):
            raise BadRecord(raw.record, problem)
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
            advice = bad.advice or "pass --on-bad-record skip to skip and list such records"
            raise CorpusError(
                f"{source.path or source.name}: record {bad.record}: {bad.reason} ({advice})"
            )
        return SkippedDocument(
            source=source.name, record=bad.record, doc_id=bad.doc_id, reason=bad.reason
        )
