"""Bits per character, the held-out measure that compares models with different tokenizers,
defined once for `vocagno eval` (apps/evaluation/bits_per_character.py) and stage 2's
`--eval-every` (stage2_train/evaluation.py), so that both give one number for one model.

A document is encoded as its model's family frames it (BOS per its policy, no EOS); a family
without BOS gets its EOS as the first context (as lm-evaluation-harness does for rolling
log-likelihoods), so every character of the text is predicted. Its tokens are scored in
overlapping windows of the context (pipeline.scoring.windows, a stride of half a window), each
token exactly once. Bits per character = the sum of the scored tokens' losses (nats) / ln 2 / the
characters covered: the text's characters less those of tokens nothing predicts.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.tokenizer import Encoding, TextTokenizer


def context_prefix(tokenizer: TextTokenizer) -> list[int]:
    """A token to predict the first text token from, when the family adds no BOS."""
    if tokenizer.policy.add_bos or tokenizer.eos_id is None:
        return []
    return [tokenizer.eos_id]


def framed_sequences(
    tokenizer: TextTokenizer, texts: list[str]
) -> tuple[list[Encoding], list[np.ndarray], int]:
    """Each text's encoding, the token ids a model scores it from (the context prefix first), and
    the prefix's length (its rows are no text token's)."""
    prefix = np.asarray(context_prefix(tokenizer), dtype=np.int32)
    encodings = tokenizer.encode_batch(texts)
    return encodings, [np.concatenate((prefix, e.ids)) for e in encodings], len(prefix)


def unscored_characters(encoding: Encoding, scored: np.ndarray) -> int:
    """The characters of the text tokens nothing predicts (`scored`: per text token)."""
    return int((encoding.end - encoding.start)[~scored].sum())


def bits(nats: float) -> float:
    return nats / math.log(2)


def bits_per_character(nats: float, characters: int) -> float:
    return bits(nats) / max(characters, 1)
