"""Context-true packing (`--packing documents`, the default). Stage 1 scores every document with
its own full context, so a student token should see its own document's context and nothing else:

- Whole documents are packed best-fit into the B rows of a micro-batch, in stream order: each
  document (or piece) goes to the fullest row that still has room for it; the first one that fits
  in no row closes the micro-batch and opens the next. Only documents longer than a window are
  split.
- Every row carries `segment_ids` (1, 2, ... per document piece in the micro-batch, 0 for padding)
  and `position_ids` that restart at 0 for each piece; the trainer masks attention to the piece
  (stage2_train.attention), so no token attends across a document boundary.
- A piece of a document holds its inputs t[a..b-1] and targets t[a+1..b]: n - 1 slots for a
  whole document of n tokens (its EOS is a target, never an input). The continuation of a split
  document re-reads the `context` tokens before its first new target as inputs whose labels are
  ignored (no loss, no selection), like stage 1's overlapping windows (stride = half a window).
- A token that is no target of its record (pipeline.corpus.targets) is labelled IGNORE_INDEX
  like a context slot: read as an input, never trained, selected or counted.
- Padding slots have label IGNORE_INDEX and a NaN teacher loss: they are no targets. A
  distillation's extras travel like the teacher loss (padding and context slots hold
  pipeline.distillation.fill_value).

Exact resume: a micro-batch is a function of the documents from its first one on, so the stream
position is the first document not yet finished plus `token`, the number of its targets already
trained (non-zero only inside a split document). Packing is per document (a Python loop over
documents, on Python integers, never over tokens); a read's documents stay in its flat arrays,
and the rows are assembled with vectorized index arithmetic, one gather per read and column.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation import fill_value
from stage2_train.data.documents import AnnotatedDocuments, DocumentReader
from stage2_train.data.plan import DataPlan
from stage2_train.data.position import StreamPosition

# Micro-batches planned, then assembled together: the assembly's fixed cost (some 40 numpy
# calls) is paid once for them. It changes no micro-batch (a test compares with groups of one).
ASSEMBLY_GROUP = 8
PAD_ID = 0  # input id of a padding slot (masked out: it attends to padding only, and is no target)


def split_context(plan: DataPlan) -> int:
    """Tokens of context a split document's continuation re-reads without loss."""
    return min(plan.seq_len - 1, int(plan.seq_len * plan.packing_context))


@dataclass
class _Read:
    """One read's annotated documents, kept whole: pieces index into its flat arrays."""

    docs: AnnotatedDocuments
    positions: list[list[int]]  # per document: (epoch, item, read, row)
    names: list[tuple[int, str]]  # per document: (epoch, doc_id)
    begin: list[int]  # per document: the index of its first token in the flat arrays
    lengths: list[int]  # per document: its tokens


class DocumentStream(DocumentReader):
    """One consumer's endless stream of document-packed micro-batches, from a saved position."""

    def __init__(self, plan: DataPlan, consumer: int, position: StreamPosition | None = None):
        super().__init__(plan, consumer, position)
        self._read: _Read | None = None  # the read holding the first document not yet finished
        self._doc = 0  # that document's index in the read
        self._done = self.start.token  # its targets already trained

    def _current(self, reader: Iterator) -> _Read:
        """The read of the first document not yet finished, reading the next one when needed."""
        while self._read is None or self._doc == len(self._read.lengths):
            docs, positions, epoch = next(reader)
            lengths = docs.lengths.tolist()
            self._read = _Read(
                docs,
                positions.tolist(),
                [(epoch, doc_id) for doc_id in docs.doc_ids],
                np.concatenate(([0], np.cumsum(lengths[:-1], dtype=np.int64))).tolist(),
                lengths,
            )
            self._doc = 0
        return self._read

    def position(self) -> StreamPosition:
        return StreamPosition(*self._read.positions[self._doc], self._done)

    def __iter__(self) -> Iterator[dict]:
        rows, width = self.plan.micro_batch_size, self.plan.seq_len
        reader = self.documents()
        while True:
            # Plan ASSEMBLY_GROUP micro-batches, build their tensors in one pass (the fixed cost
            # of the index arithmetic is shared), and hand them out one by one.
            planned = [self._plan(reader, member * rows) for member in range(ASSEMBLY_GROUP)]
            pieces = [piece for batch_pieces, _, _ in planned for piece in batch_pieces]
            tensors = _assemble(pieces, ASSEMBLY_GROUP, rows, width)
            members = {name: tensor.unbind(0) for name, tensor in tensors.items()}
            for member, (_, documents, position) in enumerate(planned):
                batch = {name: views[member] for name, views in members.items()}
                batch["documents"] = documents
                batch["position"] = position
                yield batch

    def _plan(self, reader: Iterator, first_row: int) -> tuple[list[_Piece], list, dict]:
        """The next micro-batch's pieces (in rows first_row...), the documents it begins and the
        stream position after it."""
        rows, width = self.plan.micro_batch_size, self.plan.seq_len
        context = split_context(self.plan)
        free = [width] * rows
        pieces: list[_Piece] = []
        documents = []
        while True:
            read = self._current(reader)
            doc, done = self._doc, self._done
            size = read.lengths[doc]
            first = max(0, done - context) if done else 0
            last = min(size - 1, first + width)  # index of the piece's last target
            length = last - first
            # best fit: the fullest row with room for it (the first such row on a tie)
            row, room = -1, width + 1
            for candidate, space in enumerate(free):
                if length <= space < room:
                    row, room = candidate, space
            if row < 0:
                return pieces, documents, vars(self.position()).copy()
            if length:
                begin = read.begin[doc]
                segment = len(pieces) + 1
                pieces.append(
                    _Piece(first_row + row, width - room, segment, read, begin, first, done, last)
                )
                free[row] = room - length
            if done == 0:
                documents.append(read.names[doc])
            if last >= size - 1:
                self._doc, self._done = doc + 1, 0
            else:
                self._done = last


class _Piece(NamedTuple):
    """A document's span in a micro-batch: inputs t[first..last-1], targets t[first+1..last], of
    which those at document index <= done were trained before (context here)."""

    row: int
    slot: int  # where in the row it begins
    segment: int  # its number in the micro-batch, from 1
    read: _Read
    begin: int  # the document's first token in the read's flat arrays
    first: int
    done: int
    last: int


class _Tokens:
    """Every token of a group's pieces (a piece's row counts across the micro-batches), by index
    arithmetic over all of them at once: its `slot` in the flat (batches x rows x width) tensors,
    its index in its piece (`local`), its input's index in its read (`source`; its target's is
    one more), whether its target is new (`fresh`: not trained before, else context), and its
    piece's `segment`."""

    def __init__(self, pieces: list[_Piece], width: int):
        lengths = [p.last - p.first for p in pieces]
        offsets = list(itertools.accumulate(lengths, initial=0))  # each piece's first token
        # Per piece, minus its first token's index t0, so that for token t of the micro-batch:
        # slot, index in the piece, index of its input in the read, and > 0 where its target is
        # new (document index first + 1 + local > done: not trained before; else context).
        per_piece = [
            (
                p.row * width + p.slot - t0,
                -t0,
                p.begin + p.first - t0,
                p.first + 1 - p.done - t0,
                p.segment,
            )
            for p, t0 in zip(pieces, offsets[:-1], strict=True)
        ]
        token = np.arange(offsets[-1], dtype=np.int64)
        per_token = np.repeat(np.array(per_piece, dtype=np.int64), lengths, axis=0)
        self.slot, self.local, self.source, fresh = (per_token[:, c] + token for c in range(4))
        self.fresh = fresh > 0
        self.segment = per_token[:, 4]
        # Consecutive pieces of one read are one token range: gather per read, not per piece.
        self.pieces = pieces
        self.runs = [i for i, p in enumerate(pieces) if i == 0 or p.read is not pieces[i - 1].read]
        self.bounds = [offsets[i] for i in self.runs] + [offsets[-1]]

    def take(self, values_of, index: np.ndarray) -> np.ndarray:
        """`values_of(docs)` at `index` (one per token), gathered once per read."""
        if len(self.runs) == 1:
            return values_of(self.pieces[0].read.docs)[index]
        return np.concatenate([
            values_of(self.pieces[i].read.docs)[index[a:b]]
            for i, a, b in zip(self.runs, self.bounds[:-1], self.bounds[1:], strict=True)
        ])  # fmt: skip


def _assemble(pieces: list[_Piece], batches: int, rows: int, width: int) -> dict:
    """The tensors of `batches` micro-batches, shaped (batches, rows, width, ...), from their
    pieces: one gather per column from each read the pieces come from."""
    shape = (batches, rows, width)
    size = batches * rows * width
    input_ids = np.full(size, PAD_ID, dtype=np.int64)
    labels = np.full(size, IGNORE_INDEX, dtype=np.int64)
    teacher_loss = np.full(size, np.nan, dtype=np.float32)
    position_ids = np.zeros(size, dtype=np.int64)
    segment_ids = np.zeros(size, dtype=np.int64)
    chunk_start = np.zeros(size, dtype=bool)
    extras = {}
    if pieces:
        tokens = _Tokens(pieces, width)
        slot, fresh, take = tokens.slot, tokens.fresh, tokens.take
        target = tokens.source + 1  # the index of each slot's target in its read
        input_ids[slot] = take(lambda d: d.ids, tokens.source)
        trained = fresh & take(lambda d: d.target, target)  # new, and a target of its record
        labels[slot] = np.where(trained, take(lambda d: d.ids, target), IGNORE_INDEX)
        teacher_loss[slot] = np.where(
            fresh, take(lambda d: d.teacher_loss, target), np.float32(np.nan)
        )
        position_ids[slot] = tokens.local
        segment_ids[slot] = tokens.segment
        # Chunk starts of the targets; and each piece's first new target begins a chunk, since
        # token 0 (where a document's first chunk begins) is never a target here, and a
        # continuation is selected on its own, as a chunk cut by a micro-batch boundary is
        # (pipeline.chunk_selection).
        fresh_before = np.concatenate(([False], fresh[:-1])) & (tokens.local > 0)
        chunk_start[slot] = fresh & (take(lambda d: d.chunk_start, target) | ~fresh_before)
        extras = _extras(tokens, target, shape)
    return {
        "input_ids": torch.from_numpy(input_ids.reshape(shape)),
        "labels": torch.from_numpy(labels.reshape(shape)),
        "teacher_loss": torch.from_numpy(teacher_loss.reshape(shape)),
        "position_ids": torch.from_numpy(position_ids.reshape(shape)),
        "segment_ids": torch.from_numpy(segment_ids.reshape(shape)),
        "chunk_start": torch.from_numpy(chunk_start.reshape(shape)),
    } | extras


def _extras(tokens: _Tokens, target: np.ndarray, shape: tuple) -> dict[str, torch.Tensor]:
    """A distillation's extras of the targets, travelling like the teacher loss (padding and
    context slots hold their fill_value)."""
    size, fresh, extras = int(np.prod(shape)), tokens.fresh, {}
    for name in tokens.pieces[0].read.docs.extras:
        values = tokens.take(lambda d, name=name: d.extras[name], target)
        blank = fill_value(values.dtype)
        extra = np.full((size, *values.shape[1:]), blank, dtype=values.dtype)
        extra[tokens.slot] = np.where(fresh.reshape(-1, *[1] * (values.ndim - 1)), values, blank)
        extras[name] = torch.from_numpy(extra.reshape(*shape, *values.shape[1:]))
    return extras
