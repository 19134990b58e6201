"""Token ids with character offsets, and the repairs that make a tokenizer's offsets honest.

`pipeline.tokenizer` applies them to what the tokenizers library returns, over a whole batch of
documents at once (a per-token document index keeps every repair inside its document):
  - SentencePiece's dummy prefix: a token that is only the prepended "▁" is reported with the span
    of the next character, which the next token also covers; it gets the zero-width span it has
    in the text (zero_dummy_prefix).
  - Characters a normalizer drops (Qwen2.5's NFC folds "e" + U+0301 into "é" and reports only the
    "e"), and characters a vocabulary lacks, belong to the token before them (to the first token
    at the start of the text), so every character of a document with any token is covered by
    some token (cover_dropped_characters).
  - BOS and EOS are added here, with the zero-width spans (0, 0) and (len, len) (framed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Encoding:
    """One document's tokens. `start`/`end` are character offsets into the text, end exclusive."""

    ids: np.ndarray  # int32
    start: np.ndarray  # int32
    end: np.ndarray  # int32

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class Encodings:
    """Several documents' tokens, concatenated in order; document i has `lengths[i]` tokens."""

    ids: np.ndarray  # int32
    start: np.ndarray  # int32
    end: np.ndarray  # int32
    lengths: np.ndarray  # int64

    def split(self) -> list[Encoding]:
        """One Encoding per document (views of these arrays)."""
        if self.lengths.size == 0:
            return []
        cuts = np.cumsum(self.lengths)[:-1]
        return [
            Encoding(ids, start, end)
            for ids, start, end in zip(
                np.split(self.ids, cuts),
                np.split(self.start, cuts),
                np.split(self.end, cuts),
                strict=True,
            )
        ]


def zero_dummy_prefix(
    ids: np.ndarray, start: np.ndarray, end: np.ndarray, document: np.ndarray, prefix_id: int
) -> None:
    """Give a lone dummy-prefix token ("▁" before "1" in "1") its true, zero-width span.

    The library reports it with the span of the character after it, which the next token of the
    same document also starts at; a real space token never shares its start with the token after
    it.
    """
    dummy = np.flatnonzero(
        (ids[:-1] == prefix_id) & (start[1:] == start[:-1]) & (document[1:] == document[:-1])
    )
    end[dummy] = start[dummy]


def cover_dropped_characters(
    start: np.ndarray, end: np.ndarray, document: np.ndarray, text_lengths: np.ndarray
) -> None:
    """Extend spans over characters no token reports, so every character has a token.

    Per document: a gap after a token joins that token (NFC's dropped combining mark belongs to
    its base character); a gap before the first token joins the first token. Spans stay in text
    order. A document with no token with a width (only characters the vocabulary lacks: SmolLM2
    has no token for six control bytes) has nothing to give them to and stays without.
    """
    wide = np.flatnonzero(end > start)
    if wide.size == 0:
        return
    owner = document[wide]
    # The running maximum of the ends within each document: offset by the document's number
    # times a bound on any end, so that one running maximum restarts at every document.
    bound = np.int64(text_lengths.max()) + 1
    shift = owner * bound
    reach = np.maximum.accumulate(end[wide] + shift) - shift
    turn = owner[1:] != owner[:-1]  # the next wide token is another document's
    last = np.append(turn, True)  # the last wide token of its document
    next_start = np.where(last, text_lengths[owner], np.append(start[wide[1:]], 0))
    gap = next_start > reach
    end[wide[gap]] = next_start[gap]
    start[wide[np.insert(turn, 0, True)]] = 0  # the first wide token of its document


def framed(raw: Encodings, text_lengths: np.ndarray, bos_id: int | None, eos_id: int | None
            ) -> Encodings:  # fmt: skip
    """The documents with a BOS (span (0, 0)) before and an EOS (span (len, len)) after each."""
    if bos_id is None and eos_id is None:
        return raw
    before, after = int(bos_id is not None), int(eos_id is not None)
    lengths = raw.lengths + before + after
    ends = np.cumsum(lengths)
    ids = np.empty(int(ends[-1]) if ends.size else 0, dtype=np.int32)
    start, end = np.empty_like(ids), np.empty_like(ids)
    # raw token j of document d moves right by the framing tokens of documents 0..d-1 (and d's BOS)
    shift = np.arange(raw.lengths.size) * (before + after) + before
    place = np.arange(raw.ids.size) + np.repeat(shift, raw.lengths)
    ids[place], start[place], end[place] = raw.ids, raw.start, raw.end
    if before:
        first = ends - lengths
        ids[first], start[first], end[first] = bos_id, 0, 0
    if after:
        ids[ends - 1], start[ends - 1], end[ends - 1] = eos_id, text_lengths, text_lengths
    return Encodings(ids, start, end, lengths)
