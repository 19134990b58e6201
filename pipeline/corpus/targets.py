"""Which characters of a record are training targets (`--targets`; docs/instruction-data.md).

- `all`: every character (a pretraining corpus; the default).
- `spans`: the record's own character spans, `[[start, end], ...]` in its text (end exclusive,
  Python string indices, as the cache's token offsets), ascending and not overlapping.
- `chat`: the record's `messages` (`[{"role": ..., "content": ...}, ...]`) rendered to one text
  by a named template (`TEMPLATES`); the assistant turns are the spans, each with its
  end-of-turn marker, so that a student learns where a turn ends.

Stage 1 scores the whole text (the teacher sees the context); stage 2 trains only on student
tokens that are targets by `target_tokens`' rule. The spans travel in the cache's `target_spans`
column (pipeline.cache.schema), so a cache carries the targets it was scored for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

Spans = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ChatTemplate:
    """How one message becomes text: `before` + content + `after`, with `{role}` filled in; an
    assistant turn's span is its content and `after`'s first `closing` characters."""

    before: str
    after: str
    closing: int  # characters of `after` that are the end-of-turn marker (trained)

    def describe(self) -> dict:
        return {"before": self.before, "after": self.after, "closing": self.closing}


TEMPLATES = {
    # the ChatML turns of SmolLM2-Instruct, Qwen2.5-Instruct and many others (no system prompt
    # is added: the messages are rendered as given)
    "chatml": ChatTemplate("<|im_start|>{role}\n", "<|im_end|>\n", len("<|im_end|>")),
    # a template of no special tokens, for tokenizers without ChatML's
    "plain": ChatTemplate("{role}: ", "\n\n", 0),
}
ASSISTANT = "assistant"


class BadTargets(ValueError):
    """A record's spans or messages are unusable; the message says why (the corpus names it)."""


def checked_spans(value: Any, text_length: int) -> Spans:
    """The spans of a record, or BadTargets: a list of [start, end] integer pairs with
    0 <= start < end <= text_length, ascending and not overlapping, at least one."""
    if not isinstance(value, list | tuple) or not value:
        raise BadTargets(
            f"target spans must be a non-empty list of [start, end], not {value!r:.60}"
        )
    spans, previous_end = [], 0
    for index, span in enumerate(value):
        if (
            not isinstance(span, list | tuple)
            or len(span) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)
        ):
            raise BadTargets(f"target span {index} is {span!r:.40}, not [start, end] integers")
        start, end = span
        if not 0 <= start < end <= text_length:
            what = "reversed or empty" if start >= end else "outside the text"
            raise BadTargets(
                f"target span {index} [{start}, {end}] is {what} (the text has {text_length} "
                "characters)"
            )
        if start < previous_end:
            raise BadTargets(
                f"target span {index} [{start}, {end}] overlaps or precedes the span before it"
            )
        spans.append((start, end))
        previous_end = end
    return tuple(spans)


def checked_messages(messages: Any) -> list[dict]:
    """A record's messages, or BadTargets: a non-empty list of dicts, each with a string role
    and content (other keys are kept: a tokenizer's own template may read them)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise BadTargets(f"messages must be a non-empty list, not {messages!r:.60}")
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise BadTargets(f"message {index} needs a string role and content: {message!r:.60}")
    return list(messages)


def render_chat(messages: Any, template: ChatTemplate) -> tuple[str, Spans]:
    """The text of `messages` and its assistant spans, or BadTargets."""
    parts, spans, length = [], [], 0
    for message in checked_messages(messages):
        role, content = message["role"], message["content"]
        before = template.before.format(role=role)
        trained = len(content) + template.closing  # the content and its end-of-turn marker
        if role == ASSISTANT and trained:
            start = length + len(before)
            spans.append((start, start + trained))
        turn = before + content + template.after
        parts.append(turn)
        length += len(turn)
    if not spans:
        raise BadTargets("no assistant message with content: the record has no targets")
    return "".join(parts), tuple(spans)


def target_tokens(
    token_start: np.ndarray,
    token_end: np.ndarray,
    token_lengths: np.ndarray,
    text_lengths: np.ndarray,
    spans: np.ndarray,
    spans_per_document: np.ndarray,
) -> np.ndarray:
    """Per token of consecutive documents (offsets within each document's text), whether it is
    a target of the documents' `spans` ([n, 2], each document's in order, `spans_per_document`
    of them): a token with characters when any of them lies inside a span (so every character
    of a span is trained, and a token straddling a span's edge is trained whole); a token
    without characters (BOS, an appended EOS) when it closes a span, i.e. the character before
    it is a span's. Vectorized over the read."""
    start = np.asarray(token_start, dtype=np.int64)
    end = np.asarray(token_end, dtype=np.int64)
    documents = np.arange(len(text_lengths))
    # each document in its own stretch of one line, a character apart from the next
    base = np.concatenate(([0], np.cumsum(np.asarray(text_lengths, dtype=np.int64) + 1)[:-1]))
    span_base = np.repeat(base, spans_per_document)
    span_start, span_end = spans[:, 0] + span_base, spans[:, 1] + span_base
    token_base = np.repeat(base[documents], token_lengths)
    first = np.where(start == end, start - 1, start) + token_base
    after = end + token_base
    nearest = np.searchsorted(span_end, first, side="right")  # the first span ending after it
    target = nearest < span_end.size
    target[target] = span_start[nearest[target]] < after[target]
    return target


def span_problems(spans: np.ndarray, spans_per_document: np.ndarray, text_lengths) -> np.ndarray:
    """Per document, whether its stored spans break checked_spans' rules (a cache's check)."""
    doc = np.repeat(np.arange(len(spans_per_document)), spans_per_document)
    limit = np.asarray(text_lengths, dtype=np.int64)[doc]
    bad = (spans[:, 0] < 0) | (spans[:, 0] >= spans[:, 1]) | (spans[:, 1] > limit)
    same_doc = doc[1:] == doc[:-1]
    bad[1:] |= same_doc & (spans[1:, 0] < spans[:-1, 1])  # overlapping or out of order
    problems = np.bincount(doc[bad], minlength=len(spans_per_document)) > 0
    return problems | (np.asarray(spans_per_document) == 0)


def targets_identity(mode: str, column: str) -> dict:
    """What a cache records of how its targets were read: the mode and the record field (and,
    for chat, its template's: named_template_identity, or a tokenizer's own)."""
    return {"mode": mode, "column": column}


def named_template_identity(template: str) -> dict:
    """A named template's record: its strings (a changed template is another rendering)."""
    return {"name": template, **TEMPLATES[template].describe()}
