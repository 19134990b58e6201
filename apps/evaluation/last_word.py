"""Greedy last-word accuracy: a held-out metric that is not the average loss (LAMBADA's recipe).

The paper and Rho-1 claim downstream accuracy, not loss, so the regime experiment
(docs/regime.md) reports, beside bits per character, how often a model's greedy continuation
of the text so far is exactly the last word of each line (a verse, in the shipped KJV corpus).
As lm-evaluation-harness scores LAMBADA (`acc`: the continuation is the greedy one), a word counts
as predicted when every token covering its characters is the model's top-1 token given all the
text before it: greedy decoding from the text before the word would then write exactly those
tokens. The whole document is scored once, in stage 1's windows, with the top-1 id kept; a word
is the last run of letters (and inner apostrophes) on its line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from apps.evaluation.bits_per_character import score_documents
from pipeline.cache.schema import TOPK_IDS
from pipeline.tokenizer import TextTokenizer

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def last_word_spans(text: str) -> np.ndarray:
    """(start, end) character offsets of the last word of each line that has one: int64 [n, 2]."""
    spans, line_start = [], 0
    for line in text.split("\n"):
        words = list(WORD.finditer(line))
        if words:
            spans.append((line_start + words[-1].start(), line_start + words[-1].end()))
        line_start += len(line) + 1
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def words_predicted(
    start: np.ndarray, end: np.ndarray, greedy: np.ndarray, spans: np.ndarray
) -> np.ndarray:
    """Per span, whether the tokens overlapping it (sorted offsets `start`, `end`) are all greedy;
    a span no token covers counts as missed."""
    first = np.searchsorted(end, spans[:, 0], side="right")  # first token ending after its start
    stop = np.searchsorted(start, spans[:, 1], side="left")  # tokens starting before its end
    misses = np.concatenate(([0], np.cumsum(~greedy)))
    return (stop > first) & (misses[stop] == misses[first])


@dataclass(frozen=True)
class LastWordAccuracy:
    accuracy: float
    words: int
    correct: int
    documents: int
    per_document_correct: tuple[int, ...] = ()  # for bootstrapping differences over documents
    per_document_words: tuple[int, ...] = ()

    def to_json(self) -> dict:
        out = self.__dict__.copy()
        out["per_document_correct"] = list(self.per_document_correct)
        out["per_document_words"] = list(self.per_document_words)
        return out


def last_word_accuracy(
    scorer, tokenizer: TextTokenizer, texts: list[str], scored: tuple | None = None
) -> LastWordAccuracy:
    """`scorer`: a stage-1 scorer whose extras keep the top-1 id (HeadExtras(topk=1));
    `scored`: score_documents' result with that scorer, if already computed."""
    encodings, columns = scored or score_documents(scorer, tokenizer, texts)
    correct, words = [], []
    for text, encoding, loss, top in zip(
        texts, encodings, columns["loss"], columns[TOPK_IDS], strict=True
    ):
        greedy = ~np.isnan(loss) & (np.asarray(top)[:, 0] == encoding.ids)
        spans = last_word_spans(text)
        hits = words_predicted(encoding.start, encoding.end, greedy, spans)
        correct.append(int(hits.sum()))
        words.append(len(spans))
    total = sum(words)
    return LastWordAccuracy(
        accuracy=sum(correct) / max(total, 1),
        words=total,
        correct=sum(correct),
        documents=len(texts),
        per_document_correct=tuple(correct),
        per_document_words=tuple(words),
    )
