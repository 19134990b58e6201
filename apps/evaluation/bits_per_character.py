"""Held-out loss in bits per character: the one loss that compares models with different tokenizers,
as pipeline.bits_per_character defines it (stage 2's --eval-every computes the same).

Per-token losses come from stage 1's scorer (same windows, same fp32 chunked head), so a model is
measured here exactly as a teacher is scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.bits_per_character import bits, framed_sequences, unscored_characters
from pipeline.bits_per_character import bits_per_character as per_character
from pipeline.tokenizer import TextTokenizer


@dataclass(frozen=True)
class BitsPerCharacter:
    bits_per_character: float
    bits_per_token: float
    documents: int
    characters: int
    tokens: int
    unscored_characters: int  # characters of tokens nothing predicts (no BOS and no EOS)
    per_document_bits: tuple[float, ...] = ()  # for bootstrapping differences over documents
    per_document_characters: tuple[int, ...] = ()

    def to_json(self) -> dict:
        out = self.__dict__.copy()
        out["per_document_bits"] = [round(b, 4) for b in self.per_document_bits]
        out["per_document_characters"] = list(self.per_document_characters)
        return out


def score_documents(scorer, tokenizer: TextTokenizer, texts: list[str]) -> tuple[list, dict]:
    """Each text's encoding and the scorer's columns for its tokens (the context prefix's rows
    dropped): one scoring pass that every per-document metric can read."""
    encodings, sequences, prefix = framed_sequences(tokenizer, texts)
    columns = scorer.score_columns(sequences)
    return encodings, {name: [c[prefix:] for c in cs] for name, cs in columns.items()}


def bits_per_character(
    scorer, tokenizer: TextTokenizer, texts: list[str], scored: tuple | None = None
) -> BitsPerCharacter:
    """`scorer` is a stage-1 scorer; `scored`: score_documents' result, if already computed."""
    encodings, columns = scored or score_documents(scorer, tokenizer, texts)
    losses = columns["loss"]
    nats, tokens, unscored_chars = 0.0, 0, 0
    doc_bits, doc_chars = [], []
    for text, encoding, loss in zip(texts, encodings, losses, strict=True):
        scored = ~np.isnan(loss)
        doc_nats = float(loss[scored].astype(np.float64).sum())
        doc_unscored = unscored_characters(encoding, scored)
        nats += doc_nats
        tokens += int(scored.sum())
        unscored_chars += doc_unscored
        doc_bits.append(bits(doc_nats))
        doc_chars.append(len(text) - doc_unscored)
    characters = sum(len(t) for t in texts) - unscored_chars
    return BitsPerCharacter(
        bits_per_character=per_character(nats, characters),
        bits_per_token=bits(nats) / max(tokens, 1),
        documents=len(texts),
        characters=characters,
        tokens=tokens,
        unscored_characters=unscored_chars,
        per_document_bits=tuple(doc_bits),
        per_document_characters=tuple(doc_chars),
    )
