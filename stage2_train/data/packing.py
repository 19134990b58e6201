"""Packing. Documents are concatenated into one token stream per consumer; a micro-batch is
B windows of seq_len + 1 tokens with stride seq_len, so window i's last token is window i+1's
first input and every token after the stream's first is a target exactly once. Windows cut
documents wherever they fall; attention is not masked at document boundaries (the EOS/BOS between
documents tells the student where one ends). The teacher loss of a target token travels with it,
and so does whether it begins a chunk (`chunk_start`, for the chunk baseline), and a distillation's
extras (pipeline.distillation); a token that is no target (pipeline.corpus.targets) is labelled
IGNORE_INDEX, so the loss, the selection and the metrics never count it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

import numpy as np
import torch

from pipeline.cross_entropy import IGNORE_INDEX
from stage2_train.data.documents import AnnotatedDocuments, DocumentReader
from stage2_train.data.plan import DataPlan
from stage2_train.data.position import StreamPosition


class ConsumerStream(DocumentReader):
    """One consumer's endless stream of micro-batches, starting at a saved position."""

    def __init__(self, plan: DataPlan, consumer: int, position: StreamPosition | None = None):
        super().__init__(plan, consumer, position)
        # The token buffer: concatenated documents, each with its start (relative to the buffer;
        # negative for a document already partly consumed) and its position tuple.
        self._ids = np.zeros(0, dtype=np.int32)
        self._teacher = np.zeros(0, dtype=np.float32)
        self._chunk_start = np.zeros(0, dtype=bool)
        self._target = np.zeros(0, dtype=bool)
        self._extras: dict[str, np.ndarray] = {}
        self._doc_start = np.zeros(0, dtype=np.int64)
        self._doc_length = np.zeros(0, dtype=np.int64)
        self._doc_position = np.zeros((0, 4), dtype=np.int64)  # epoch, item, read, row
        self._doc_ids: list[tuple[int, str]] = []  # (epoch, doc_id)

    def _append(self, docs: AnnotatedDocuments, positions: np.ndarray, epoch: int) -> None:
        first_token = np.cumsum(docs.lengths) - docs.lengths
        self._doc_start = np.concatenate((self._doc_start, self._ids.size + first_token))
        self._doc_length = np.concatenate((self._doc_length, docs.lengths))
        self._doc_position = np.concatenate((self._doc_position, positions))
        self._doc_ids.extend((epoch, doc_id) for doc_id in docs.doc_ids)
        self._ids = np.concatenate((self._ids, docs.ids))
        self._teacher = np.concatenate((self._teacher, docs.teacher_loss))
        self._chunk_start = np.concatenate((self._chunk_start, docs.chunk_start))
        self._target = np.concatenate((self._target, docs.target))
        for name, values in docs.extras.items():
            held = self._extras.get(name)
            self._extras[name] = values if held is None else np.concatenate((held, values))

    def _advance(self, tokens: int) -> None:
        """Drop `tokens` tokens from the front, and the documents that lie wholly before it."""
        self._ids, self._teacher = self._ids[tokens:], self._teacher[tokens:]
        self._chunk_start, self._target = self._chunk_start[tokens:], self._target[tokens:]
        self._extras = {name: values[tokens:] for name, values in self._extras.items()}
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
            chunk_start = self._chunk_start[window]
            labels = np.where(self._target[window][:, 1:], ids[:, 1:], IGNORE_INDEX)
            extras = {
                name: torch.from_numpy(np.ascontiguousarray(values[window][:, 1:]))
                for name, values in self._extras.items()
            }
            new = (self._doc_start >= 0) & (self._doc_start < consumed)
            documents = [self._doc_ids[i] for i in np.flatnonzero(new)]
            self._advance(consumed)
            yield {
                "input_ids": torch.from_numpy(ids[:, :-1].astype(np.int64)),
                "labels": torch.from_numpy(labels.astype(np.int64)),
                "teacher_loss": torch.from_numpy(np.ascontiguousarray(teacher[:, 1:])),
                "chunk_start": torch.from_numpy(np.ascontiguousarray(chunk_start[:, 1:])),
                **extras,
                "documents": documents,
                "position": asdict(self.position()),
            }
