"""The held-out documents of `--eval-every` (stage2_train.evaluation): the first `--eval-docs`
documents of `--eval-data` (any corpus spec, as `vocagno eval --data` reads it), read and cut into
batches once, before the first step.

Each document is framed and windowed as pipeline.bits_per_character defines it, with the student's
tokenizer and `--seq-len` for the context: every token after the first scored exactly once, with at
least half a window of left context. The windows are packed in document order into rows of
`--seq-len` slots (a window's last token is only a target, so a window takes one slot fewer than
its tokens), several short windows to a row under the document mask of `--packing documents`, and
the rows into batches of `--micro-batch-size`: fixed by the documents, the tokenizer and those two
options, never by the world size.

Never trained on, checked: no held-out text may be the text of a document in the training cache
(the cache records each document's sha256, `text_sha256`). Only that column is read, each rank
reading every world-size-th shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from pipeline.bits_per_character import framed_sequences, unscored_characters
from pipeline.cache.manifest import ShardRecord
from pipeline.cache.schema import TEXT_SHA256, iter_shard_batches
from pipeline.corpus import Corpus, Document
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.errors import ConfigError
from pipeline.io import sha256_text
from pipeline.scoring.windows import default_stride, plan_windows
from pipeline.storage.store import child, masked
from pipeline.tokenizer import TextTokenizer
from stage2_train.data.document_packing import PAD_ID

HASH_READ_ROWS = 1 << 16


@dataclass(frozen=True)
class HeldOut:
    """The held-out set as the evaluation reads it: its batches, and the totals that do not
    depend on the model (the scored tokens and the characters they cover)."""

    spec: str
    doc_ids: tuple[str, ...]
    hashes: tuple[str, ...]  # sha256_text of each document's text, as a cache records it
    tokens: int
    characters: int
    batches: tuple[dict[str, torch.Tensor], ...]

    @property
    def documents(self) -> int:
        return len(self.doc_ids)


def first_documents(spec: str, count: int) -> list[Document]:
    """The first `count` documents of the corpus (a bad record stops with its file and record)."""
    documents = []
    for document in Corpus(spec):
        if len(documents) == count:
            break
        documents.append(document)
    return documents


def read_heldout(
    spec: str, count: int, tokenizer: TextTokenizer, seq_len: int, rows: int
) -> HeldOut:
    """The first `count` documents of `spec`, in batches of `rows` rows of `seq_len` slots."""
    documents = first_documents(spec, count)
    texts = [d.text for d in documents]
    encodings, sequences, prefix = framed_sequences(tokenizer, texts)
    tokens = unscored = 0
    for encoding, sequence in zip(encodings, sequences, strict=True):
        scored = np.arange(len(sequence)) >= 1 if len(sequence) >= 2 else np.zeros(0, bool)
        text_scored = np.zeros(len(encoding.ids), dtype=bool)
        text_scored[: max(len(scored) - prefix, 0)] = scored[prefix:]
        tokens += int(scored.sum())
        unscored += unscored_characters(encoding, text_scored)
    if tokens == 0:
        raise ConfigError(
            f"--eval-data {masked(spec)}: no token of its {len(documents)} document(s) read is "
            "one the student predicts"
        )
    return HeldOut(
        spec=spec,
        doc_ids=tuple(d.doc_id for d in documents),
        hashes=tuple(sha256_text(t) for t in texts),
        tokens=tokens,
        characters=sum(map(len, texts)) - unscored,
        batches=pack_windows(sequences, seq_len, rows),
    )


def pack_windows(
    sequences: list[np.ndarray], seq_len: int, rows: int
) -> tuple[dict[str, torch.Tensor], ...]:
    """Every sequence's windows (pipeline.scoring.windows), in order, each a segment of a row:
    inputs its tokens but the last, labels the next tokens from its first scored one on."""
    stride = default_stride(seq_len)
    pieces, row, fill = [], 0, 0  # (row, slot, segment, sequence, start, end, score_from)
    segment = 0
    for index, sequence in enumerate(sequences):
        for start, end, score_from in plan_windows(len(sequence), seq_len, stride).tolist():
            width = end - start - 1
            if fill + width > seq_len:
                row, fill, segment = row + 1, 0, 0
            segment += 1
            pieces.append((row, fill, segment, index, start, end, score_from))
            fill += width
    total = -(-(row + 1) // rows) * rows if pieces else 0
    input_ids = np.full((total, seq_len), PAD_ID, dtype=np.int64)
    labels = np.full((total, seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((total, seq_len), dtype=np.int64)
    segment_ids = np.zeros((total, seq_len), dtype=np.int64)
    for row, slot, segment, index, start, end, score_from in pieces:
        width, sequence = end - start - 1, sequences[index]
        span = slice(slot, slot + width)
        input_ids[row, span] = sequence[start : end - 1]
        labels[row, span] = sequence[start + 1 : end]
        labels[row, slot : slot + score_from - start - 1] = IGNORE_INDEX  # scored before
        position_ids[row, span] = np.arange(width)
        segment_ids[row, span] = segment
    columns = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
               "segment_ids": segment_ids}  # fmt: skip
    return tuple(
        {name: torch.from_numpy(values[first : first + rows]) for name, values in columns.items()}
        for first in range(0, total, rows)
    )


def check_unseen(
    heldout: HeldOut, cache, shards: list[ShardRecord], rank: int, world_size: int, gather
) -> None:
    """ConfigError on every rank if a held-out text is the text of a training document. Each rank
    reads the hashes of every `world_size`-th shard; `gather` collects each rank's first find."""
    wanted = pa.array(heldout.hashes, type=pa.string())
    found = None
    for index in range(rank, len(shards), world_size):
        path, first_row = child(cache, shards[index].file), 0
        for batch in iter_shard_batches(path, [TEXT_SHA256], HASH_READ_ROWS, use_threads=False):
            hits = np.flatnonzero(pc.is_in(batch.column(0), value_set=wanted).to_numpy(False))
            if hits.size:
                digest = batch.column(0)[int(hits[0])].as_py()
                found = (index, shards[index].file, first_row + int(hits[0]), digest)
                break
            first_row += batch.num_rows
        if found:
            break
    finds = sorted(f for f in gather(found) if f is not None)
    if finds:
        _, file, row, digest = finds[0]
        doc_id = heldout.doc_ids[heldout.hashes.index(digest)]
        raise ConfigError(
            f"--eval-data {masked(heldout.spec)}: held-out document {doc_id!r} is trained on (the "
            f"same text as row {row} of the cache's {file}): hold out documents the cache "
            "does not hold"
        )
