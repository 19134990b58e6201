"""The log-probability of each problem's answer given its question, in bits per character.

A problem is "Question: ...\nAnswer: <steps> #### N"; its answer section is everything after
"\nAnswer:". A record read with target spans (`--targets spans|chat`, pipeline.corpus.targets)
has its spans for answer instead, the characters stage 2 trains on. The whole text is scored once
(stage 1's scorer, as for bits per character) and the losses of the answer's tokens, by stage 2's
rule (pipeline.corpus.targets.target_tokens), are summed: -log2 p(answer | question).
Divided by the answer's characters it compares models with different tokenizers. Per-problem
values are kept so differences between models can be bootstrapped over problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.bits_per_character import context_prefix
from pipeline.corpus.targets import Spans, target_tokens
from pipeline.errors import CorpusError
from pipeline.tokenizer import TextTokenizer

ANSWER_MARK = "\nAnswer:"


def answer_start(text: str) -> int:
    """Offset of the answer section's first character."""
    at = text.find(ANSWER_MARK)
    if at < 0:
        raise CorpusError(
            "held-out document has no '\\nAnswer:' line: answer bits read 'Question: ... "
            "\\nAnswer: ...' problems (--answer-problems 0 skips them)"
        )
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


def answer_bits(
    scorer, tokenizer: TextTokenizer, texts: list[str], spans: list[Spans] | None = None
) -> AnswerBits:
    """`scorer` is a stage-1 scorer (`score(list[token ids]) -> list[losses]`), batched; `spans`,
    each text's answer spans (None: its answer section)."""
    prefix = context_prefix(tokenizer)
    if spans is None:
        spans = [((answer_start(t), len(t)),) for t in texts]
    encodings = tokenizer.encode_batch(texts)
    sequences = [np.concatenate((np.asarray(prefix, dtype=np.int32), e.ids)) for e in encodings]
    losses = [loss[len(prefix) :] for loss in scorer.score(sequences)]
    bits = np.empty(len(texts))
    unscored = 0
    for row, (encoding, loss, answer_spans) in enumerate(zip(encodings, losses, spans, strict=True)):
        bounds = np.asarray(answer_spans, dtype=np.int64).reshape(-1, 2)
        target = target_tokens(
            encoding.start, encoding.end, [len(encoding)], [len(texts[row])], bounds, [len(bounds)]
        )
        answer = np.asarray(loss[target], dtype=np.float64)
        unscored += int(np.isnan(answer).sum())
        bits[row] = np.nansum(answer) / math.log(2)
    characters = np.array([sum(end - start for start, end in s) for s in spans], dtype=np.int64)
    return AnswerBits(bits=bits, characters=characters, unscored_tokens=unscored)
