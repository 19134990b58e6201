"""What a corpus is made of: its options, the documents it yields, and a record that is not one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.choices import (
    CHAT_TEMPLATES,
    ON_BAD_RECORD,
    TARGETS,
    TEXT_SPLITS,
    ChatTemplate,
    OnBadRecord,
    Targets,
    TextSplit,
)


@dataclass(frozen=True)
class CorpusOptions:
    text_column: str = "text"
    id_column: str | None = None
    split: str = "train"
    text_split: TextSplit = "file"
    on_bad_record: OnBadRecord = "error"
    targets: Targets = "all"  # pipeline.corpus.targets
    spans_column: str = "target_spans"  # targets "spans": the field of [[start, end], ...]
    messages_column: str = "messages"  # targets "chat": the field of the messages, as text
    chat_template: ChatTemplate = "chatml"
    max_docs: int | None = None  # only the corpus's first N records (a skipped one counts)

    @property
    def targets_column(self) -> str | None:
        """The record field that names the targets (read beside the text), or None: all."""
        return {"spans": self.spans_column, "chat": self.messages_column}.get(self.targets)

    def __post_init__(self) -> None:
        if not self.text_column:
            raise ValueError("text_column must not be empty")
        if self.targets not in TARGETS:
            raise ValueError(f"targets must be one of {TARGETS}, not {self.targets!r}")
        if self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(
                f"chat_template must be one of {CHAT_TEMPLATES}, not {self.chat_template!r}"
            )
        if self.max_docs is not None and self.max_docs < 1:
            raise ValueError(f"max_docs must be at least 1, not {self.max_docs}")
        if self.targets_column == "":
            raise ValueError(f"the {self.targets} column must not be empty")
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
    target_spans: tuple[tuple[int, int], ...] | None = None  # None: every character a target


class BadRecord(Exception):
    """One unusable record; the corpus turns it into an error or a skip.

    Sources yield it (a raise would end their generator); value checks raise it.
    """

    def __init__(
        self, record: int, reason: str, doc_id: str | None = None, advice: str | None = None
    ):
        super().__init__(reason)
        self.record = record
        self.reason = reason
        self.doc_id = doc_id
        self.advice = advice  # what to do, where skipping the record is not the likely fix


@dataclass(frozen=True)
class RawRecord:
    """What a source found at one record: values not yet checked."""

    record: int
    text: Any  # None where the record's text is rendered from its messages (targets "chat")
    doc_id: Any = None
    targets: Any = None  # the targets column's value (pipeline.corpus.targets)


# Written at the start of a file by many Windows tools; `datasets` and pandas accept it.
UTF8_BOM = b"\xef\xbb\xbf"


def surrogate_problem(text: str, what: str) -> str | None:
    """Why `text` has no UTF-8 spelling, or None. A lone surrogate is valid JSON (`"\\ud800"`) and
    what Python makes of undecodable command-line bytes, but can be neither tokenized nor stored."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"{what} holds a lone surrogate U+{ord(text[exc.start]):04X} at character "
            f"{exc.start}: not encodable as UTF-8"
        )
    return None


def decode_utf8(value: bytes, record: int) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRecord(record, f"invalid UTF-8 at byte {exc.start}") from None


def checked(parse, *args) -> RawRecord | BadRecord:
    try:
        return parse(*args)
    except BadRecord as bad:
        return bad
