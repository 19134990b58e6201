"""Token-level Lexical Alignment (paper section 3.1, Algorithm 1) and the paper's chunk baseline.

For a student token with characters [st, ed):
  j = the first teacher token whose end > st,
  k = the last teacher token whose start < ed,
and the mapping is the inclusive teacher range (j, k), or -1 (unmapped) where no teacher token
overlaps. Both searches run over the whole sequence at once, no Python loop: each is done as one
merge of the sorted student offsets into the sorted teacher offsets (a stable argsort of two
ascending runs, linear for tokenizer output and about twice as fast as `np.searchsorted`). The range
is exactly the teacher tokens that share a character with the student token, so it covers every
character of it (IoS = 1) whenever the teacher tokenization covers the text, which
`pipeline.tokenizer` guarantees. Spans must be in text order, as tokenizers produce them.

Rules for real-world offsets (each has a test; docs/alignment.md shows the spans behind them):
  - Zero-width spans (BOS/EOS, SentencePiece's lone dummy-prefix "▁", any end == start) carry no
    characters: a zero-width student token is unmapped, and a zero-width teacher token is never
    part of a range's ends (the searches skip it).
  - Several tokens sharing one character (byte-fallback `<0xF0><0x9F>...`, byte-level pieces of one
    CJK character or emoji) are mapped together: each of them overlaps the student token, and
    each carries part of that character's bytes.
  - Partly overlapping spans (Qwen2.5's "ĠâĪ" [4, 6) then "ļ" [5, 6) for " √") are searched over
    the running maximum of teacher ends and the running minimum (from the right) of teacher
    starts, which is exactly "first end > st" and "last start < ed" even where the raw arrays
    are not monotone.
  - Leading-space tokens (`▁x`, `Ġx`) include the space in their span; alignment uses spans as the
    tokenizer reports them, so " x" in one tokenizer maps to both " " and "x" in another.
  - Normalizers (NFC/NFKC, space rewriting) are undone by the tokenizers library, so offsets index
    the original text on both sides; characters a normalizer drops are given to a neighbouring
    token by `pipeline.tokenizer`.
"""

from __future__ import annotations

import numpy as np

from pipeline.choices import AGGREGATIONS, Aggregation

DEFAULT_AGGREGATION: Aggregation = "max"  # the paper's choice; every option's default reads this
UNMAPPED = -1


def align(
    student_start: np.ndarray,
    student_end: np.ndarray,
    teacher_start: np.ndarray,
    teacher_end: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Map each student token to its minimal covering teacher range; returns (map_start, map_end).

    Both are int64 arrays of the student's length, inclusive, -1 where unmapped.
    """
    s_start, s_end = np.asarray(student_start), np.asarray(student_end)
    t_start, t_end = np.asarray(teacher_start), np.asarray(teacher_end)
    wide = (t_end > t_start).nonzero()[0]  # zero-width teacher tokens cover nothing
    if wide.size == 0 or s_start.size == 0:
        unmapped = np.full(s_start.shape, UNMAPPED, dtype=np.int64)
        return unmapped, unmapped.copy()
    ends, starts = t_end[wide], t_start[wide]
    # Real tokenizers give spans in order, and checking is far cheaper than accumulating.
    # (count_nonzero rather than .any(): these calls are a fair share of a short document's time.)
    if np.count_nonzero(ends[1:] < ends[:-1]):
        ends = np.maximum.accumulate(ends)
    if np.count_nonzero(starts[1:] < starts[:-1]):
        starts = np.minimum.accumulate(starts[::-1])[::-1]

    low = _count_before(ends, s_start, inclusive=True)  # first with end > st
    high = _count_before(starts, s_end, inclusive=False) - 1  # last with start < ed
    mapped = (low <= high) & (s_end > s_start)
    wide_or_unmapped = np.concatenate((wide, [UNMAPPED]))
    map_start = wide_or_unmapped[np.where(mapped, low, wide.size)]
    map_end = wide_or_unmapped[np.where(mapped, high, wide.size)]
    return map_start, map_end


def _count_before(values: np.ndarray, keys: np.ndarray, *, inclusive: bool) -> np.ndarray:
    """For each key, how many of the ascending `values` are < key (<= key when inclusive).

    This is `searchsorted`, done as a merge: a stable argsort of two ascending runs is one linear
    timsort merge, about twice as fast as a binary search per key. Ties go to the run placed
    first. Keys out of order (never from a tokenizer) still get exact counts, just more slowly.
    """
    first, second = (values, keys) if inclusive else (keys, values)
    order = np.argsort(np.concatenate((first, second)), kind="stable")
    is_key = order >= values.size if inclusive else order < keys.size
    slots = is_key.nonzero()[0]  # where the keys landed, in ascending key order
    counts = slots - np.arange(keys.size)  # a key's place in the merge, less the keys before it
    if np.count_nonzero(keys[1:] < keys[:-1]):
        key_index = order[slots] - (values.size if inclusive else 0)
        counts[key_index] = counts.copy()
    return counts


def aggregate_teacher_loss(
    teacher_loss: np.ndarray,
    map_start: np.ndarray,
    map_end: np.ndarray,
    how: Aggregation = DEFAULT_AGGREGATION,
) -> np.ndarray:
    """Φ over each student token's teacher range (paper eq. 2), NaN-aware; float32.

    Unscored teacher tokens (NaN) are ignored; a range with no scored token, and an unmapped
    student token, give NaN.
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {how!r}")
    # max picks one of the float32 values, so float32 is exact; sums accumulate in float64
    loss = np.asarray(teacher_loss, dtype=np.float32 if how == "max" else np.float64)
    map_start = np.asarray(map_start, dtype=np.int64)
    map_end = np.asarray(map_end, dtype=np.int64)
    mapped = map_start >= 0
    out = np.full(map_start.shape, np.nan, dtype=np.float32)
    if loss.size == 0 or not mapped.any():
        return out
    # reduceat over interleaved (first, stop) bounds reduces loss[first:stop] at the even slots;
    # one padding element lets `stop` equal len(loss). Each range is reduced on its own (no prefix
    # sums), so one huge or infinite loss cannot leak into other tokens' values.
    first = map_start[mapped]
    bounds = np.empty(2 * first.size, dtype=np.int64)
    bounds[0::2], bounds[1::2] = first, map_end[mapped] + 1
    scored = ~np.isnan(loss)
    if how == "max":
        values = np.append(np.where(scored, loss, -np.inf), -np.inf)
        result = np.maximum.reduceat(values, bounds)[0::2]
        any_scored = np.logical_or.reduceat(np.append(scored, False), bounds)[0::2]
    else:
        count = np.add.reduceat(np.append(scored, False).astype(np.int64), bounds)[0::2]
        result = np.add.reduceat(np.append(np.where(scored, loss, 0.0), 0.0), bounds)[0::2]
        if how == "mean":
            result = result / np.maximum(count, 1)
        any_scored = count > 0
    out[mapped] = np.where(any_scored, result, np.nan)
    return out


def chunk_bounds(length: int, num_chunks: int) -> np.ndarray:
    """Token boundaries of `num_chunks` equal chunks (sizes differ by at most one)."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be at least 1, not {num_chunks}")
    return (np.arange(num_chunks + 1, dtype=np.int64) * length) // num_chunks


def chunk_of(position: np.ndarray, length: np.ndarray, num_chunks: int) -> np.ndarray:
    """The equal chunk (of `chunk_bounds(length, num_chunks)`) that holds each token position:
    the largest c with c * length // num_chunks <= position, i.e. ((position + 1) * n - 1) //
    length. Elementwise over arrays, so many documents take one call."""
    position = np.asarray(position, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    return ((position + 1) * num_chunks - 1) // np.maximum(length, 1)


def equal_chunk_alignment(
    num_student: int | np.ndarray, num_teacher: int | np.ndarray, num_chunks: int
) -> tuple[np.ndarray, np.ndarray]:
    """The paper's chunking baseline (section 2, Table 2): student chunk c maps to teacher chunk c.

    Returned in the same (map_start, map_end) form as `align`, so aggregation is shared: every
    student token of chunk c maps to the whole teacher chunk c (-1 if it is empty). Given arrays
    of per-document token counts, the documents are concatenated on both sides (indices into the
    concatenated teacher tokens), still with no loop.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be at least 1, not {num_chunks}")
    n_student = np.atleast_1d(np.asarray(num_student, dtype=np.int64))
    n_teacher = np.atleast_1d(np.asarray(num_teacher, dtype=np.int64))
    first_student = np.cumsum(n_student) - n_student
    first_teacher = np.cumsum(n_teacher) - n_teacher
    position = np.arange(int(n_student.sum())) - np.repeat(first_student, n_student)
    chunk = chunk_of(position, np.repeat(n_student, n_student), num_chunks)
    teachers = np.repeat(n_teacher, n_student)
    lo = chunk * teachers // num_chunks
    hi = (chunk + 1) * teachers // num_chunks - 1
    empty = hi < lo
    shift = np.repeat(first_teacher, n_student)
    map_start = np.where(empty, UNMAPPED, lo + shift)
    map_end = np.where(empty, UNMAPPED, hi + shift)
    return map_start, map_end


def chunk_starts(num_student: np.ndarray, num_chunks: int) -> np.ndarray:
    """For consecutive documents of these token counts: True at each token that begins one of its
    document's equal chunks (a document's first token always does), so a chunk never spans two
    documents. Chunks longer than the document hold no token and mark nothing."""
    n_student = np.asarray(num_student, dtype=np.int64)
    first = np.cumsum(n_student) - n_student
    position = np.arange(int(n_student.sum())) - np.repeat(first, n_student)
    chunk = chunk_of(position, np.repeat(n_student, n_student), num_chunks)
    start = np.ones(chunk.shape, dtype=bool)
    start[1:] = (chunk[1:] != chunk[:-1]) | (position[1:] == 0)
    return start


def span_overlap(
    a_start: np.ndarray, a_end: np.ndarray, b_start: np.ndarray, b_end: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Character IoU and IoS (intersection over the `a` side) of paired spans [start, end)."""
    a_start, a_end, b_start, b_end = (
        np.asarray(x, dtype=np.int64) for x in (a_start, a_end, b_start, b_end)
    )
    inter = np.clip(np.minimum(a_end, b_end) - np.maximum(a_start, b_start), 0, None)
    union = (a_end - a_start) + (b_end - b_start) - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, inter / np.maximum(union, 1), np.nan)
        ios = np.where(a_end > a_start, inter / np.maximum(a_end - a_start, 1), np.nan)
    return iou, ios


def token_alignment_overlap(
    student_start: np.ndarray,
    student_end: np.ndarray,
    teacher_start: np.ndarray,
    teacher_end: np.ndarray,
    map_start: np.ndarray,
    map_end: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per student token: character IoU / IoS against the span of its mapped teacher range.

    The teacher side of a range (j, k) is [start of j, end of k); NaN for unmapped tokens.
    """
    map_start = np.asarray(map_start)
    mapped = map_start >= 0
    j = np.where(mapped, map_start, 0)
    k = np.where(mapped, map_end, 0)
    t_start = np.asarray(teacher_start)[j] if len(teacher_start) else np.zeros_like(j)
    t_end = np.asarray(teacher_end)[k] if len(teacher_end) else np.zeros_like(k)
    iou, ios = span_overlap(student_start, student_end, t_start, t_end)
    return np.where(mapped, iou, np.nan), np.where(mapped, ios, np.nan)


def chunk_alignment_overlap(
    student_start: np.ndarray,
    student_end: np.ndarray,
    teacher_start: np.ndarray,
    teacher_end: np.ndarray,
    num_chunks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk pair (paper Figure 3): character IoU / IoS of student chunk c vs teacher chunk c,
    cut by `chunk_bounds` exactly as `equal_chunk_alignment` cuts them for training.

    A chunk's characters are [first token's start, last token's end); NaN for an empty chunk and
    for a student chunk without characters (only BOS/EOS): its IoS is undefined.
    """
    s_bounds = chunk_bounds(len(student_start), num_chunks)
    t_bounds = chunk_bounds(len(teacher_start), num_chunks)

    def chunk_spans(start, end, bounds):
        start, end = np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)
        nonempty = bounds[1:] > bounds[:-1]
        first = np.where(nonempty, bounds[:-1], 0)
        last = np.where(nonempty, bounds[1:] - 1, 0)
        lo = start[first] if start.size else np.zeros_like(first)
        hi = end[last] if end.size else np.zeros_like(last)
        return np.where(nonempty, lo, 0), np.where(nonempty, hi, 0), nonempty

    s_lo, s_hi, s_ok = chunk_spans(student_start, student_end, s_bounds)
    t_lo, t_hi, t_ok = chunk_spans(teacher_start, teacher_end, t_bounds)
    iou, ios = span_overlap(s_lo, s_hi, t_lo, t_hi)
    ok = s_ok & t_ok & (s_hi > s_lo)
    return np.where(ok, iou, np.nan), np.where(ok, ios, np.nan)
