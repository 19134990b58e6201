"""Overlapping windows over documents longer than the teacher's context, so that every token is
scored exactly once, with as much left context as the window allows.

For a document of n tokens, a context of L tokens (`max_length`) and a step of S tokens
(`stride`, 1 <= S < L), window i covers tokens [s_i, e_i) with

    s_i = min(i * S, max(n - L, 0)),    e_i = min(s_i + L, n),

and scores the tokens [f_i, e_i) with f_0 = 1 and f_i = e_{i-1}: the tokens that the previous
window did not reach. Each scored token after the first window has at least L - S tokens of left
context; the last window is pulled back to end exactly at n, so it is never short of context.
Token 0 has no prediction and stays unscored (NaN).

BOS: the tokenizer's framing policy puts BOS at token 0 of the document only (it is the token the
model conditions the first text token on). Later windows start mid-document without a BOS, the
way lm-evaluation-harness scores rolling windows: the L - S overlap supplies the context, and a
BOS inserted mid-text would be a token the model never saw there in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def default_stride(max_length: int) -> int:
    """Half a window: every token after the first window keeps at least L/2 tokens of context."""
    return max(1, max_length // 2)


def validate_window(max_length: int, stride: int) -> None:
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, not {max_length}")
    if not 1 <= stride < max_length:
        raise ValueError(
            f"stride must be at least 1 and less than max_length ({max_length}), not {stride}; "
            "a stride of max_length would leave each window's first token without context"
        )


def plan_windows(num_tokens: int, max_length: int, stride: int) -> np.ndarray:
    """Windows over one document: int64 rows (start, end, score_from); none if n < 2."""
    validate_window(max_length, stride)
    if num_tokens < 2:
        return np.empty((0, 3), dtype=np.int64)
    last_start = max(num_tokens - max_length, 0)
    count = -(-last_start // stride) + 1  # ceil(last_start / stride) windows after the first
    starts = np.minimum(np.arange(count, dtype=np.int64) * stride, last_start)
    ends = np.minimum(starts + max_length, num_tokens)
    score_from = np.concatenate(([1], ends[:-1]))
    return np.stack([starts, ends, score_from], axis=1)


@dataclass(frozen=True)
class WindowTable:
    """The windows of many documents, flat: window w covers doc[w] tokens [start, end)."""

    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    score_from: np.ndarray

    def __len__(self) -> int:
        return int(self.doc.shape[0])

    @property
    def length(self) -> np.ndarray:
        return self.end - self.start

    @property
    def scored(self) -> np.ndarray:
        return self.end - self.score_from


def plan_document_windows(lengths: list[int], max_length: int, stride: int) -> WindowTable:
    """Windows of every document, in document order."""
    per_doc = [plan_windows(n, max_length, stride) for n in lengths]
    counts = [len(w) for w in per_doc]
    flat = np.concatenate(per_doc) if per_doc else np.empty((0, 3), dtype=np.int64)
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    return WindowTable(doc=doc, start=flat[:, 0], end=flat[:, 1], score_from=flat[:, 2])
