"""Stream the cache into packed training sequences whose target tokens carry teacher losses.

Partition. Consumers are (rank, data-loader worker) pairs, C = world size x workers per rank.
A work item is one part of one shard: part p of P holds the shard's rows r with r % P == p, and
P = ceil(C / #shards) so that even a cache with fewer shards than consumers feeds everyone. In
epoch e the items are permuted by (seed, e) and consumer c takes items c, c + C, c + 2C, ...:
disjoint parts whose union is every row, so each document is used exactly once per epoch.
Within one Parquet read (READ_ROWS rows) the item's rows are shuffled by (seed, e, shard, read).
Each consumer's stream is endless (epoch after epoch), so every rank runs exactly --max-steps.
Consumers get equally many items (+-1); a consumer that finishes its part of epoch e goes on to
its part of epoch e + 1, so with few items per consumer (fewer shards than ~10x the consumers)
some documents come round again before others have been seen once.

Per document (vectorized over a whole read, no per-token Python loop): check text_sha256, tokenize
`text` with the student tokenizer (BOS per the student's policy, EOS appended), align to the
cached teacher offsets (pipeline.alignment.align, or equal chunks for the chunk baseline; one call
for the read, with every document's offsets shifted apart), aggregate the teacher losses of each
student token's range. NaN marks a student token with no teacher loss.

Packing. Documents are concatenated into one token stream per consumer; a micro-batch is
B windows of seq_len + 1 tokens with stride seq_len, so window i's last token is window i+1's
first input and every token after the stream's first is a target exactly once. Windows cut
documents wherever they fall; attention is not masked at document boundaries (the EOS/BOS between
documents tells the student where one ends). The teacher loss of a target token travels with it.

Position. After each micro-batch a consumer's place is (epoch, item, read, row, token): the
document where the next window starts and the token offset inside it. Every micro-batch carries
its consumer's position; a checkpoint stores the last consumed one per consumer, and a resumed
stream re-reads that document and drops `token` tokens, so it continues exactly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.alignment import aggregate_teacher_loss, align, equal_chunk_alignment
from pipeline.cache.manifest import CacheManifest, ShardRecord, load_manifest
from pipeline.cache.schema import (
    DOC_ID,
    LOSS,
    TEXT,
    TEXT_SHA256,
    TOKEN_END,
    TOKEN_START,
    iter_shard_batches,
)
from pipeline.cache.verify import verify_shard
from pipeline.errors import CacheError, VocagnoError
from pipeline.io import fingerprint, sha256_text
from pipeline.tokenizer import TextTokenizer, load_tokenizer

READ_ROWS = 128  # rows per Parquet read: the I/O unit and the shuffle window inside an item
READ_COLUMNS = [DOC_ID, TEXT, TEXT_SHA256, TOKEN_START, TOKEN_END, LOSS]


@dataclass(frozen=True)
class DataPlan:
    """Everything that fixes the stream; identical on every rank and worker."""

    cache_dir: Path
    shards: tuple[ShardRecord, ...]
    student_tokenizer: str
    seq_len: int
    micro_batch_size: int
    alignment: str = "token"  # or "chunk", or "identity" (see choose_alignment)
    num_chunks: int = 1
    aggregate: str = "max"
    seed: int = 0
    world_size: int = 1
    num_workers: int = 0

    @classmethod
    def from_cache(cls, cache_dir: Path, **settings) -> DataPlan:
        """A plan over every shard the cache's manifest lists."""
        return cls(
            cache_dir=Path(cache_dir), shards=tuple(load_manifest(cache_dir).shards), **settings
        )

    @property
    def consumers_per_rank(self) -> int:
        return max(1, self.num_workers)

    @property
    def consumers(self) -> int:
        return self.world_size * self.consumers_per_rank

    def __post_init__(self) -> None:
        rows = sum(shard.rows for shard in self.shards)
        if rows < self.consumers:
            raise CacheError(
                f"the cache has {rows} documents, fewer than the {self.consumers} data consumers "
                f"({self.world_size} ranks x {self.consumers_per_rank} data-loader workers); "
                "use fewer workers or ranks"
            )

    @functools.cached_property
    def parts_per_shard(self) -> int:
        """The fewest parts per shard that give every consumer at least one non-empty item."""
        parts = max(1, math.ceil(self.consumers / max(1, len(self.shards))))
        while sum(min(shard.rows, parts) for shard in self.shards) < self.consumers:
            parts += 1
        return parts


@dataclass(frozen=True)
class StreamPosition:
    """Where a consumer's token stream continues (see the module docstring)."""

    epoch: int = 0
    item: int = 0
    read: int = 0
    row: int = 0
    token: int = 0


def cache_fingerprint(manifest: CacheManifest) -> str:
    """Identity of a cache's content: its producer and every shard's size and checksum."""
    return fingerprint(
        {"producer": manifest.producer_fingerprint, "shards": [asdict(s) for s in manifest.shards]}
    )


def work_items(plan: DataPlan, consumer: int, epoch: int) -> list[tuple[int, int]]:
    """(shard list index, part) items of one consumer in one epoch: a pure function of its inputs.

    Empty parts (of shards with fewer rows than parts) are no items, so each consumer has at least
    one document per epoch.
    """
    parts = plan.parts_per_shard
    items = [
        (shard, part)
        for shard, record in enumerate(plan.shards)
        for part in range(min(parts, record.rows))
    ]
    order = np.random.default_rng([plan.seed, epoch]).permutation(len(items))
    return [items[i] for i in order[consumer :: plan.consumers]]


@functools.cache
def _verify_once(cache_dir: str, record: ShardRecord, mtime_ns: int | None) -> Path:
    return verify_shard(cache_dir, record)


def verified_shard(cache_dir: Path, record: ShardRecord) -> Path:
    """pipeline.cache.verify.verify_shard (size and sha256 against the manifest), hashed once per
    process and file version rather than once per read."""
    path = Path(cache_dir) / record.file
    mtime_ns = path.stat().st_mtime_ns if path.exists() else None
    return _verify_once(str(cache_dir), record, mtime_ns)


@dataclass
class AnnotatedDocuments:
    """Student tokens of consecutive documents with the teacher loss of each token."""

    ids: np.ndarray  # int32, all documents concatenated
    teacher_loss: np.ndarray  # float32, NaN = no teacher loss for that token
    lengths: np.ndarray  # int64 student tokens per document
    doc_ids: list[str] = field(default_factory=list)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(values)[:-1])).astype(np.int64)


def choose_alignment(guidance: str, student_fingerprint: str, cache_tokenizer: dict) -> str:
    """chunk for the chunk baseline; identity when the student's tokenizer is the teacher's
    (same-vocabulary guidance, Rho-1); otherwise token-level lexical alignment.

    With one tokenizer on both sides, offsets cannot tell the byte pieces of one character apart
    (they share a span) and would map each piece to the whole group; positions can.
    """
    if guidance == "chunk":
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
    aggregate: str = "max",
) -> AnnotatedDocuments:
    """Tokenize documents with the student tokenizer and give every token its teacher loss.

    Teacher arrays are the cached columns of these documents, flattened in order.
    """
    encodings = tokenizer.encode_batch(texts, add_eos=True)
    lengths = np.fromiter((len(e) for e in encodings), dtype=np.int64, count=len(encodings))
    if not encodings:
        empty = np.zeros(0, dtype=np.int32)
        return AnnotatedDocuments(empty, np.zeros(0, dtype=np.float32), lengths)
    ids = np.concatenate([e.ids for e in encodings])
    if alignment == "token":
        # Shift each document's offsets past the previous one (plus a gap, so that zero-width
        # spans at a boundary touch neither side): one align call serves the whole read.
        text_lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
        base = _exclusive_cumsum(text_lengths + 1)
        student_shift = np.repeat(base, lengths)
        teacher_shift = np.repeat(base, teacher_lengths)
        map_start, map_end = align(
            np.concatenate([e.start for e in encodings]) + student_shift,
            np.concatenate([e.end for e in encodings]) + student_shift,
            teacher_start + teacher_shift,
            teacher_end + teacher_shift,
        )
    elif alignment == "chunk":
        pairs = [
            equal_chunk_alignment(int(n_s), int(n_t), num_chunks)
            for n_s, n_t in zip(lengths, teacher_lengths, strict=True)
        ]
        offset = np.repeat(_exclusive_cumsum(teacher_lengths), lengths)  # document's first teacher
        map_start = np.concatenate([p[0] for p in pairs])
        map_end = np.concatenate([p[1] for p in pairs])
        mapped = map_start >= 0
        map_start = np.where(mapped, map_start + offset, -1)
        map_end = np.where(mapped, map_end + offset, -1)
    elif alignment == "identity":
        # Student token i is teacher token i; the student's trailing EOS has no teacher token.
        position = np.arange(ids.size) - np.repeat(_exclusive_cumsum(lengths), lengths)
        mapped = position < np.repeat(teacher_lengths, lengths)
        first_teacher = np.repeat(_exclusive_cumsum(teacher_lengths), lengths)
        map_start = np.where(mapped, position + first_teacher, -1)
        map_end = map_start
    else:
        raise ValueError(f"alignment must be 'token', 'chunk' or 'identity', not {alignment!r}")
    per_token = aggregate_teacher_loss(teacher_loss, map_start, map_end, aggregate)
    return AnnotatedDocuments(ids.astype(np.int32), per_token, lengths)


def _list_column(batch: pa.RecordBatch, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list<...> column as (flat values, per-row lengths)."""
    column = batch.column(name)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    return values, lengths


class ConsumerStream:
    """One consumer's endless stream of micro-batches, starting at a saved position."""

    def __init__(self, plan: DataPlan, consumer: int, position: StreamPosition | None = None):
        self.plan = plan
        self.consumer = consumer
        self.start = position or StreamPosition()
        self.tokenizer = load_tokenizer(plan.student_tokenizer)
        # The token buffer: concatenated documents, each with its start (relative to the buffer;
        # negative for a document already partly consumed) and its position tuple.
        self._ids = np.zeros(0, dtype=np.int32)
        self._teacher = np.zeros(0, dtype=np.float32)
        self._doc_start = np.zeros(0, dtype=np.int64)
        self._doc_length = np.zeros(0, dtype=np.int64)
        self._doc_position = np.zeros((0, 4), dtype=np.int64)  # epoch, item, read, row
        self._doc_ids: list[tuple[int, str]] = []  # (epoch, doc_id)

    # -- reading -----------------------------------------------------------------------------
    def documents(self) -> Iterator[tuple[AnnotatedDocuments, np.ndarray, int]]:
        """Annotated documents read by read, with their positions and epoch, from `self.start`."""
        plan, start = self.plan, self.start
        epoch = start.epoch
        while True:
            items = work_items(plan, self.consumer, epoch)
            first_item = start.item if epoch == start.epoch else 0
            for item in range(first_item, len(items)):
                resume = epoch == start.epoch and item == start.item
                yield from self._read_item(epoch, item, *items[item], start if resume else None)
            epoch += 1

    def _read_item(
        self, epoch: int, item: int, shard: int, part: int, resume: StreamPosition | None
    ) -> Iterator[tuple[AnnotatedDocuments, np.ndarray, int]]:
        plan = self.plan
        record = plan.shards[shard]
        path = verified_shard(plan.cache_dir, record)
        parts = plan.parts_per_shard
        rows_seen = 0
        for read, batch in enumerate(iter_shard_batches(path, READ_COLUMNS, READ_ROWS)):
            first_row, rows_seen = rows_seen, rows_seen + batch.num_rows
            if resume is not None and read < resume.read:
                continue
            mine = np.flatnonzero((first_row + np.arange(batch.num_rows)) % parts == part)
            order = np.random.default_rng([plan.seed, epoch, shard, read]).permutation(mine.size)
            skip = resume.row if resume is not None and read == resume.read else 0
            rows = np.arange(skip, mine.size)
            if rows.size == 0:
                continue
            docs = self._annotate_rows(batch.take(pa.array(mine[order][skip:])), path)
            positions = np.empty((rows.size, 4), dtype=np.int64)
            positions[:] = (epoch, item, read, 0)
            positions[:, 3] = rows
            yield docs, positions, epoch
        if rows_seen != record.rows:
            raise CacheError(
                f"shard {path} has {rows_seen} rows but the manifest says {record.rows}"
            )

    def _annotate_rows(self, batch: pa.RecordBatch, path: Path) -> AnnotatedDocuments:
        texts = batch.column(TEXT).to_pylist()
        doc_ids = batch.column(DOC_ID).to_pylist()
        for doc_id, text, digest in zip(
            doc_ids, texts, batch.column(TEXT_SHA256).to_pylist(), strict=True
        ):
            if sha256_text(text) != digest:
                raise CacheError(
                    f"shard {path}: document {doc_id!r} does not match its text_sha256"
                )
        start, lengths = _list_column(batch, TOKEN_START, np.int64)
        end, _ = _list_column(batch, TOKEN_END, np.int64)
        loss, loss_lengths = _list_column(batch, LOSS, np.float32)
        text_lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
        if (
            not np.array_equal(lengths, loss_lengths)
            or (end > np.repeat(text_lengths, lengths)).any()
            or (start > end).any()
        ):
            raise CacheError(f"shard {path}: teacher offsets or losses do not fit their texts")
        docs = annotate(
            self.tokenizer,
            texts,
            start,
            end,
            loss,
            lengths,
            alignment=self.plan.alignment,
            num_chunks=self.plan.num_chunks,
            aggregate=self.plan.aggregate,
        )
        docs.doc_ids = doc_ids
        return docs

    # -- packing -----------------------------------------------------------------------------
    def _append(self, docs: AnnotatedDocuments, positions: np.ndarray, epoch: int) -> None:
        self._doc_start = np.concatenate(
            (self._doc_start, self._ids.size + _exclusive_cumsum(docs.lengths))
        )
        self._doc_length = np.concatenate((self._doc_length, docs.lengths))
        self._doc_position = np.concatenate((self._doc_position, positions))
        self._doc_ids.extend((epoch, doc_id) for doc_id in docs.doc_ids)
        self._ids = np.concatenate((self._ids, docs.ids))
        self._teacher = np.concatenate((self._teacher, docs.teacher_loss))

    def _advance(self, tokens: int) -> None:
        """Drop `tokens` tokens from the front, and the documents that lie wholly before it."""
        self._ids, self._teacher = self._ids[tokens:], self._teacher[tokens:]
        self._doc_start = self._doc_start - tokens
        alive = np.flatnonzero(self._doc_start + self._doc_length > 0)
        first = int(alive[0]) if alive.size else len(self._doc_ids)
        self._doc_start, self._doc_length = self._doc_start[first:], self._doc_length[first:]
        self._doc_position = self._doc_position[first:]
        self._doc_ids = self._doc_ids[first:]

    def position(self) -> StreamPosition:
        """The position of the buffer's front: where the next window starts."""
        front = int(np.searchsorted(self._doc_start, 0, side="right")) - 1
        epoch, item, read, row = (int(v) for v in self._doc_position[front])
        return StreamPosition(epoch, item, read, row, int(-self._doc_start[front]))

    def __iter__(self) -> Iterator[dict]:
        length, rows = self.plan.seq_len, self.plan.micro_batch_size
        consumed = rows * length
        window = np.arange(rows)[:, None] * length + np.arange(length + 1)[None, :]
        reader = self.documents()
        skip = self.start.token
        while True:
            while self._ids.size < consumed + 1 or skip:
                self._append(*next(reader))
                if skip:  # a resumed stream: that much of its first document was consumed
                    self._advance(skip)
                    skip = 0
            ids, teacher = self._ids[window], self._teacher[window]
            new = (self._doc_start >= 0) & (self._doc_start < consumed)
            documents = [self._doc_ids[i] for i in np.flatnonzero(new)]
            self._advance(consumed)
            yield {
                "input_ids": torch.from_numpy(ids[:, :-1].astype(np.int64)),
                "labels": torch.from_numpy(ids[:, 1:].astype(np.int64)),
                "teacher_loss": torch.from_numpy(np.ascontiguousarray(teacher[:, 1:])),
                "documents": documents,
                "position": asdict(self.position()),
            }


class CacheStream(IterableDataset):
    """One rank's stream: each data-loader worker plays one of the rank's consumers.

    `first_consumer` rotates the roles so that a resumed loader's first batch comes from the
    consumer whose turn it was (DataLoader always starts with worker 0).
    """

    def __init__(
        self, plan: DataPlan, rank: int, positions: list[StreamPosition], first_consumer: int
    ):
        super().__init__()
        if len(positions) != plan.consumers_per_rank:
            raise ValueError("one position per consumer of this rank is needed")
        self.plan, self.rank = plan, rank
        self.positions, self.first_consumer = positions, first_consumer

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        local = ((info.id if info else 0) + self.first_consumer) % self.plan.consumers_per_rank
        consumer = self.rank * self.plan.consumers_per_rank + local
        try:
            for batch in ConsumerStream(self.plan, consumer, self.positions[local]):
                batch["consumer"] = local
                yield batch
        except VocagnoError as exc:
            # Handed over as a value: DataLoader would re-raise it with the worker's traceback
            # pasted into the message, and the user should see one clear line.
            yield {"error": exc}


def batches(loader: DataLoader) -> Iterator[dict]:
    """The loader's micro-batches; a data error from a worker is raised here, as itself."""
    for batch in loader:
        if "error" in batch:
            raise batch["error"]
        yield batch


@dataclass
class DataState:
    """A rank's data position: the last consumed position of each of its consumers, and whose
    turn is next. Saved in every checkpoint."""

    positions: list[StreamPosition]
    next_consumer: int = 0

    @classmethod
    def fresh(cls, plan: DataPlan) -> DataState:
        return cls([StreamPosition() for _ in range(plan.consumers_per_rank)])

    def observe(self, batch: dict) -> None:
        local = batch["consumer"]
        self.positions[local] = StreamPosition(**batch["position"])
        self.next_consumer = (local + 1) % len(self.positions)

    def to_dict(self) -> dict:
        return {
            "positions": [asdict(p) for p in self.positions],
            "next_consumer": self.next_consumer,
        }

    @classmethod
    def from_dict(cls, data: dict) -> DataState:
        return cls([StreamPosition(**p) for p in data["positions"]], data["next_consumer"])


def make_loader(
    plan: DataPlan, rank: int, state: DataState, pin_memory: bool = False
) -> DataLoader:
    dataset = CacheStream(plan, rank, list(state.positions), state.next_consumer)
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=plan.num_workers,
        pin_memory=pin_memory,
        prefetch_factor=4 if plan.num_workers else None,
    )
