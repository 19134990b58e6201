"""Per document (vectorized over a whole read, no per-token Python loop): check the row against
its text (pipeline.cache.rows), tokenize `text` with the student tokenizer (BOS per the student's
policy, EOS appended), and give every student token the teacher loss of the cached teacher tokens
it is aligned to (pipeline.teacher_loss: one call for the read). NaN marks a student token with no
teacher loss. Under chunk alignment every token also says whether it begins one of its document's
equal chunks (paper Table 2), so chunk selection can regroup the tokens after packing. Under a
distillation objective (pipeline.distillation) every token also gets that objective's extras, built
from the same alignment and the columns the objective reads. With other teachers' caches
(more_teachers) every token's teacher loss combines each teacher's, and it gets every teacher's
extras.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.alignment import DEFAULT_AGGREGATION, chunk_starts
from pipeline.cache.rows import (
    check_extra_columns,
    check_rows,
)
from pipeline.cache.schema import (
    DOC_ID,
    LOSS,
    TARGET_SPANS,
    TEXT,
    TEXT_SHA256,
    TOKEN_END,
    TOKEN_START,
    iter_shard_batches,
)
from pipeline.corpus.targets import target_tokens
from pipeline.distillation import AlignedRead, Distillation
from pipeline.errors import CacheError
from pipeline.guidance import GuidanceSettings
from pipeline.teacher_loss import combine_teacher_losses, student_teacher_loss
from pipeline.tokenizer import TextTokenizer, load_tokenizer
from stage2_train.data.more_teachers import RowFeed, TeacherTokens, document_teachers
from stage2_train.data.plan import DataPlan, work_items
from stage2_train.data.position import StreamPosition
from stage2_train.data.read_rows import ReadRows
from stage2_train.data.shards import verified_shard

READ_ROWS = 128  # rows per Parquet read: the I/O unit and the shuffle window inside an item
READ_COLUMNS = [DOC_ID, TEXT, TEXT_SHA256, TOKEN_START, TOKEN_END, LOSS]


@dataclass
class AnnotatedDocuments:
    """Student tokens of consecutive documents with the teacher loss of each token."""

    ids: np.ndarray  # int32, all documents concatenated
    teacher_loss: np.ndarray  # float32, NaN = no teacher loss for that token
    lengths: np.ndarray  # int64 student tokens per document
    doc_ids: list[str] = field(default_factory=list)
    # bool, True where a selection unit begins: a document's equal chunk under chunk alignment,
    # else every token (a token is its own unit)
    chunk_start: np.ndarray | None = None
    # per token (first axis), target-aligned like teacher_loss: a distillation objective's inputs
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    # bool, whether the token is a training target (a cache with target spans,
    # pipeline.corpus.targets); every token else. The packers label the others IGNORE_INDEX.
    target: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.chunk_start is None:
            self.chunk_start = np.ones(self.ids.shape, dtype=bool)
        if self.target is None:
            self.target = np.ones(self.ids.shape, dtype=bool)


def choose_alignment(
    settings: GuidanceSettings, student_fingerprint: str, cache_tokenizer: dict
) -> str:
    """chunk for the modes that declare it (the chunk baseline and its random control); identity
    when the student's tokenizer is the teacher's (same-vocabulary guidance, Rho-1); otherwise
    token-level lexical alignment.

    With one tokenizer on both sides, offsets cannot tell the byte pieces of one character apart
    (they share a span) and would map each piece to the whole group; positions can.
    """
    if settings.declared.alignment == "chunk":
        return "chunk"
    if cache_tokenizer.get("fingerprint") == student_fingerprint:
        return "identity"
    return "token"


def annotate(
    tokenizer: TextTokenizer,
    texts: list[str],
    teacher_start: np.ndarray,
    teacher_end: np.ndarray,
    teacher_loss: np.ndarray,
    teacher_lengths: np.ndarray,
    *,
    alignment: str = "token",
    num_chunks: int = 1,
    aggregate: str = DEFAULT_AGGREGATION,
    distillation: Distillation | None = None,
    teacher_columns: dict[str, np.ndarray] | None = None,
    target_spans: tuple[np.ndarray, np.ndarray] | None = None,
    more_teachers: Sequence[TeacherTokens] = (),
    combine: str = "min",
    document_teacher: np.ndarray | None = None,
) -> AnnotatedDocuments:
    """Tokenize documents with the student tokenizer and give every token its teacher loss (and
    the distillation's extras, from `teacher_columns`: its cache columns, values per token),
    and, given the documents' `target_spans` (spans [n, 2] and how many per document), whether
    it is a target (pipeline.corpus.targets.target_tokens). Given `more_teachers` (other
    teachers' tokens of the same documents), the teacher loss is every teacher's, each aligned
    on its own, combined by the rule `combine` (`source`: the teacher `document_teacher` names for
    each document, an index into the cache's and then `more_teachers`), and the distillation
    (then a TeacherMixture) builds its extras from every teacher's columns.

    Teacher arrays are the cached columns of these documents, flattened in order.
    """
    student = tokenizer.encode_concatenated(texts, add_eos=True)
    lengths, student_start, student_end = student.lengths, student.start, student.end
    if not texts:
        return AnnotatedDocuments(student.ids, np.zeros(0, dtype=np.float32), lengths)
    text_lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    teachers = [
        TeacherTokens(
            teacher_start, teacher_end, np.asarray(teacher_loss, dtype=np.float32),
            np.asarray(teacher_lengths, dtype=np.int64), alignment, teacher_columns or {},
        ),
        *more_teachers,
    ]  # fmt: skip
    mappings = _align(student, text_lengths, teachers, num_chunks, aggregate)
    ids = student.ids
    starts = chunk_starts(lengths, num_chunks) if alignment == "chunk" else None
    extras = _extras(distillation, student, text_lengths, teachers, mappings)
    target = None
    if target_spans is not None:
        target = target_tokens(student_start, student_end, lengths, text_lengths, *target_spans)
    chosen = None if document_teacher is None else np.repeat(document_teacher, lengths)
    combined = combine_teacher_losses([m.teacher_loss for m in mappings], combine, chosen)
    return AnnotatedDocuments(
        ids, combined, lengths, chunk_start=starts, extras=extras, target=target
    )


def _align(
    student,
    text_lengths: np.ndarray,
    teachers: list[TeacherTokens],
    num_chunks: int,
    aggregate: str,
) -> list:
    """Each teacher's tokens aligned to the student's on their own (pipeline.teacher_loss)."""
    return [
        student_teacher_loss(
            student.start, student.end, student.lengths, teacher.start, teacher.end, teacher.loss,
            teacher.lengths, text_lengths, alignment=teacher.alignment, num_chunks=num_chunks,
            aggregate=aggregate,
        )
        for teacher in teachers
    ]  # fmt: skip


def _extras(
    distillation: Distillation | None,
    student,
    text_lengths: np.ndarray,
    teachers: list[TeacherTokens],
    mappings: list,
) -> dict[str, np.ndarray]:
    """The distillation's extras per student token, from every teacher's aligned read."""
    if distillation is None:
        return {}
    reads = [
        AlignedRead(
            student_ids=student.ids,
            student_start=student.start,
            student_end=student.end,
            student_lengths=student.lengths,
            teacher_start=teacher.start,
            teacher_end=teacher.end,
            teacher_lengths=teacher.lengths,
            teacher_loss=teacher.loss,
            text_lengths=text_lengths,
            map_start=mapping.map_start,
            map_end=mapping.map_end,
            teacher_columns=teacher.columns,
        )
        for teacher, mapping in zip(teachers, mappings, strict=True)
    ]
    # several teachers: a TeacherMixture (pipeline.distillation.teachers) takes every read
    return (
        distillation.teacher_extras(reads) if len(teachers) > 1 else distillation.extras(reads[0])
    )


class DocumentReader:
    """One consumer's annotated documents, read by read and epoch after epoch, from a position."""

    def __init__(self, plan: DataPlan, consumer: int, position: StreamPosition | None = None):
        self.plan = plan
        self.consumer = consumer
        self.start = position or StreamPosition()
        self.tokenizer = load_tokenizer(plan.student_tokenizer)

    def documents(self) -> Iterator[tuple[AnnotatedDocuments, np.ndarray, int]]:
        """Annotated documents of each read, with their positions (epoch, item, read, row) and
        epoch, from `self.start`."""
        plan, start = self.plan, self.start
        epoch = start.epoch
        while True:
            items = work_items(plan, self.consumer, epoch)
            first_item = start.item if epoch == start.epoch else 0
            for item in range(first_item, len(items)):
                resume = epoch == start.epoch and item == start.item
                ahead = [shard for shard, _ in items[item + 1 : item + 1 + plan.read_ahead]]
                yield from self._read_item(
                    epoch, item, *items[item], start if resume else None, ahead
                )
            epoch += 1

    def _read_item(
        self,
        epoch: int,
        item: int,
        shard: int,
        part: int,
        resume: StreamPosition | None,
        ahead: list[int],
    ) -> Iterator[tuple[AnnotatedDocuments, np.ndarray, int]]:
        plan = self.plan
        record = plan.shards[shard]
        path = verified_shard(plan, record, [plan.shards[i] for i in ahead])
        feeds = self._more_feeds(shard, ahead)
        parts = plan.parts_per_shard
        rows_seen = 0
        columns = READ_COLUMNS + list(plan.distillation_columns)
        columns += [TARGET_SPANS] if plan.target_spans else []
        beyond_loss = len(columns) > len(READ_COLUMNS)  # columns `cache verify` checks, as here
        # one data-loader worker is one core: decode on it
        batches = iter_shard_batches(path, columns, READ_ROWS, use_threads=False)
        for read, batch in enumerate(batches):
            first_row, rows_seen = rows_seen, rows_seen + batch.num_rows
            others = [feed.take(batch.num_rows) for feed in feeds]
            if resume is not None and read < resume.read:
                continue
            mine = np.flatnonzero((first_row + np.arange(batch.num_rows)) % parts == part)
            order = np.random.default_rng([plan.seed, epoch, shard, read]).permutation(mine.size)
            skip = resume.row if resume is not None and read == resume.read else 0
            rows = np.arange(skip, mine.size)
            if rows.size == 0:
                continue
            own = batch if mine.size == batch.num_rows else batch.take(pa.array(mine))
            more = [
                feed.tokens(own, other, mine, order[skip:], first_row)
                for feed, other in zip(feeds, others, strict=True)
            ]
            # Checked and read in file order, then put in the read's shuffled order with numpy.
            checked = check_rows(path, own, first_row + mine)
            decoded = (
                check_extra_columns(path, own, first_row + mine, checked.lengths, plan.head_size)
                if beyond_loss
                else {}
            )
            docs = self._annotate_rows(
                ReadRows.of(own, checked, order[skip:], columns, decoded), more
            )
            positions = np.empty((rows.size, 4), dtype=np.int64)
            positions[:] = (epoch, item, read, 0)
            positions[:, 3] = rows
            yield docs, positions, epoch
        if rows_seen != record.rows:
            raise CacheError(
                f"shard {path} has {rows_seen} rows but the manifest says {record.rows}"
            )

    def _more_feeds(self, shard: int, ahead: list[int]) -> list[RowFeed]:
        """The other teachers' caches' rows of `shard`, read in step with this one."""
        return [
            RowFeed(
                verified_shard(self.plan, cache.shards[shard], [cache.shards[i] for i in ahead],
                               cache.location),
                cache.alignment,
                READ_ROWS,
                self.plan.distillation_columns,
                cache.head_size,
            )
            for cache in self.plan.more_caches
        ]  # fmt: skip

    def _annotate_rows(
        self, rows: ReadRows, more: Sequence[TeacherTokens] = ()
    ) -> AnnotatedDocuments:
        """One read's rows, annotated, with the other teachers' tokens of them (a benchmark
        overrides this to score live)."""
        docs = annotate(
            self.tokenizer,
            rows.texts,
            rows.columns[TOKEN_START],
            rows.columns[TOKEN_END],
            rows.columns[LOSS],
            rows.lengths,
            alignment=self.plan.alignment,
            num_chunks=self.plan.num_chunks,
            aggregate=self.plan.aggregate,
            distillation=self.plan.distillation,
            teacher_columns={name: rows.columns[name] for name in self.plan.distillation_columns},
            target_spans=rows.target_spans,
            more_teachers=more,
            combine=self.plan.combine_teachers,
            document_teacher=(
                document_teachers(rows.doc_ids, self.plan.source_teachers)
                if self.plan.source_teachers
                else None
            ),
        )
        docs.doc_ids = rows.doc_ids
        return docs
