"""The log-probability of each problem's answer given its question, in bits per character.

A problem is "Question: ...\nAnswer: <steps> #### N"; its answer section is everything after
"\nAnswer:". The whole text is scored once (stage 1's scorer, as for bits per character) and the
losses of the tokens that cover any answer character are summed: -log2 p(answer | question).
Divided by the answer's characters it compares models with different tokenizers. Per-problem
values are kept so differences between models can be bootstrapped over problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from apps.evaluation.bits_per_character import context_prefix
from pipeline.tokenizer import TextTokenizer

ANSWER_MARK = "\nAnswer:"


def answer_start(text: str) -> int:
    """Offset of the answer section's first character."""
    at = text.find(ANSWER_MARK)
    if at < 0:
        raise ValueError("document has no '\\nAnswer:' line")
    return at + len(ANSWER_MARK)


@dataclass(frozen=True)
class AnswerBits:
    bits: np.ndarray  # per problem: -log2 p(answer | question)
    characters: np.ndarray  # per problem: characters of the answer section
    unscored_tokens: int  # answer tokens without a loss (beyond the scoring window)

    @property
    def bits_per_character(self) -> float:
        return float(self.bits.sum() / max(int(self.characters.sum()), 1))

    def to_json(self) -> dict:
        return {
            "bits_per_character": self.bits_per_character,
            "problems": len(self.bits),
            "characters": int(self.characters.sum()),
            "unscored_tokens": self.unscored_tokens,
            "per_problem_bits": [round(float(b), 4) for b in self.bits],
            "per_problem_characters": [int(c) for c in self.characters],
        }


def answer_bits(scorer, tokenizer: TextTokenizer, texts: list[str]) -> AnswerBits:
    """`scorer` is a stage-1 scorer (`score(list[token ids]) -> list[losses]`), batched."""
    prefix = context_prefix(tokenizer)
    starts = np.array([answer_start(t) for t in texts], dtype=np.int64)
    encodings = tokenizer.encode_batch(texts)
    sequences = [np.concatenate((np.asarray(prefix, dtype=np.int32), e.ids)) for e in encodings]
    losses = [loss[len(prefix) :] for loss in scorer.score(sequences)]
    bits = np.empty(len(texts))
    unscored = 0
    for row, (encoding, loss, start) in enumerate(zip(encodings, losses, starts, strict=True)):
        answer = np.asarray(loss[encoding.end > start], dtype=np.float64)
        unscored += int(np.isnan(answer).sum())
        bits[row] = np.nansum(answer) / math.log(2)
    characters = np.array([len(t) for t in texts], dtype=np.int64) - starts
    return AnswerBits(bits=bits, characters=characters, unscored_tokens=unscored)
