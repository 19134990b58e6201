"""Held-out loss in bits per character: the one loss that compares models with different tokenizers.

Per-token losses come from stage 1's scorer (same windows, same fp32 chunked head), so a model is
measured here exactly as a teacher is scored. Bits per character = sum of token losses (nats) /
ln 2 / characters. A model without BOS gets its EOS as the first context (as lm-evaluation-harness
does for rolling log-likelihoods), so every character of every document is predicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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


def context_prefix(tokenizer: TextTokenizer) -> list[int]:
    """A token to predict the first text token from, when the family adds no BOS."""
    if tokenizer.policy.add_bos or tokenizer.eos_id is None:
        return []
    return [tokenizer.eos_id]


def score_documents(scorer, tokenizer: TextTokenizer, texts: list[str]) -> tuple[list, dict]:
    """Each text's encoding and the scorer's columns for its tokens (the context prefix's rows
    dropped): one scoring pass that every per-document metric can read."""
    prefix = context_prefix(tokenizer)
    encodings = tokenizer.encode_batch(texts)
    sequences = [np.concatenate((np.asarray(prefix, dtype=np.int32), e.ids)) for e in encodings]
    columns = scorer.score_columns(sequences)
    return encodings, {name: [c[len(prefix) :] for c in cs] for name, cs in columns.items()}


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
        doc_unscored = int((encoding.end - encoding.start)[~scored].sum())
        nats += doc_nats
        tokens += int(scored.sum())
        unscored_chars += doc_unscored
        doc_bits.append(doc_nats / math.log(2))
        doc_chars.append(len(text) - doc_unscored)
    characters = sum(len(t) for t in texts) - unscored_chars
    bits = nats / math.log(2)
    return BitsPerCharacter(
        bits_per_character=bits / max(characters, 1),
        bits_per_token=bits / max(tokens, 1),
        documents=len(texts),
        characters=characters,
        tokens=tokens,
        unscored_characters=unscored_chars,
        per_document_bits=tuple(doc_bits),
        per_document_characters=tuple(doc_chars),
    )
