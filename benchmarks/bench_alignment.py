"""How fast is Token-level Lexical Alignment, against a per-token Python loop and against
tokenizing the same text? Targets: vectorized >= 20x the loop; alignment <= 5% of tokenizing.

Documents of a few thousand student tokens are built from the shipped GSM-style corpus by
concatenating problems; each teacher tokenizer is paired with the student. Alignment is timed
with one call per document, and with one call for all documents (offsets shifted apart), which
is how stage 2 aligns a whole Parquet read. All figures come from one run on this machine and
are printed side by side: the best of --repeats timings each, taken in turn (vectorized, loop,
tokenizing) so that all three see the same machine load.

The two alignments are single-threaded and compared by CPU time, which time spent waiting for a
busy machine's cores does not inflate (wall-clock minima favour the short vectorized call). The
tokenizer uses several threads, so alignment's share of tokenizing is compared in wall time.

    python benchmarks/bench_alignment.py [--docs 32] [--tokens 3000] [--repeats 15]
"""

from __future__ import annotations

import argparse
from bisect import bisect_left, bisect_right

import numpy as np
from timing import interleaved_best_times, print_header, print_load_average

from pipeline.alignment import UNMAPPED, align
from pipeline.corpus import Corpus
from pipeline.shipped import shipped_corpus
from pipeline.tokenizer import Encoding, load_tokenizer

CORPUS = shipped_corpus("train")


def align_python(s_start, s_end, t_start, t_end) -> tuple[list[int], list[int]]:
    """Algorithm 1 as a plain loop: per student token, the same two binary searches with bisect.

    Uses the teacher ends/starts as they are (monotone on real tokenizers), zero-width ones
    skipped, so it returns what `align` returns.
    """
    s_start, s_end, t_start, t_end = (x.tolist() for x in (s_start, s_end, t_start, t_end))
    wide = [t for t, (a, b) in enumerate(zip(t_start, t_end, strict=True)) if b > a]
    starts, ends = [t_start[t] for t in wide], [t_end[t] for t in wide]
    map_start, map_end = [], []
    for st, ed in zip(s_start, s_end, strict=True):
        low = bisect_right(ends, st)  # first teacher token whose end > st
        high = bisect_left(starts, ed) - 1  # last teacher token whose start < ed
        if ed > st and low <= high:
            map_start.append(wide[low])
            map_end.append(wide[high])
        else:
            map_start.append(UNMAPPED)
            map_end.append(UNMAPPED)
    return map_start, map_end


def build_documents(student, num_docs: int, tokens: int) -> list[str]:
    """Concatenate corpus problems until each document has about `tokens` student tokens."""
    docs, parts, count = [], [], 0
    for doc in Corpus(str(CORPUS)):
        parts.append(doc.text)
        count += len(student.encode(doc.text, add_bos=False))
        if count >= tokens:
            docs.append("\n\n".join(parts))
            parts, count = [], 0
            if len(docs) == num_docs:
                break
    return docs


def align_all(align_fn, pairs) -> None:
    for s, t in pairs:
        align_fn(s.start, s.end, t.start, t.end)


def concatenated(encodings: list[Encoding], docs: list[str]) -> Encoding:
    """All documents as one sequence, offsets shifted apart as stage 2 does for a whole read."""
    lengths = np.array([len(d) + 1 for d in docs])
    shift = np.repeat(np.cumsum(lengths) - lengths, [len(e) for e in encodings])
    return Encoding(
        ids=np.concatenate([e.ids for e in encodings]),
        start=np.concatenate([e.start for e in encodings]) + shift,
        end=np.concatenate([e.end for e in encodings]) + shift,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", default="tinyllama", help="student tokenizer spec")
    parser.add_argument(
        "--teachers",
        nargs="+",
        default=["qwen2.5", "deepseek", "mistral", "smollm2"],
        help="teacher tokenizer specs",
    )
    parser.add_argument("--docs", type=int, default=32, help="number of documents")
    parser.add_argument("--tokens", type=int, default=3000, help="student tokens per document")
    parser.add_argument("--repeats", type=int, default=15, help="timings per figure (best kept)")
    args = parser.parse_args()

    student = load_tokenizer(args.student)
    docs = build_documents(student, args.docs, args.tokens)
    s_encs = student.encode_batch(docs)
    n_student = sum(len(e) for e in s_encs)
    print(
        f"{len(docs)} documents, {n_student} {args.student} tokens "
        f"({n_student / len(docs):.0f} per document, {sum(map(len, docs)) / len(docs):.0f} chars)"
    )
    print()
    header = (
        f"{'teacher':<10} {'calls':<14} {'vectorized tok/s':>17} {'python tok/s':>13} "
        f"{'speedup':>8} {'tokenize tok/s':>15} {'align / tokenize':>17}\n"
        f"{'':<25} {'(CPU time)':>17} {'(CPU time)':>13} {'':>8} {'(wall)':>15} {'(wall)':>17}"
    )
    print_header(header)
    student_all = concatenated(s_encs, docs)
    for name in args.teachers:
        t_encs = load_tokenizer(name).encode_batch(docs)
        calls = {
            "per document": list(zip(s_encs, t_encs, strict=True)),
            "one per batch": [(student_all, concatenated(t_encs, docs))],
        }
        for pairs in calls.values():  # both versions must agree before their speed means anything
            for s, t in pairs:
                fast = align(s.start, s.end, t.start, t.end)
                slow = align_python(s.start, s.end, t.start, t.end)
                assert fast[0].tolist() == slow[0] and fast[1].tolist() == slow[1], name
        tasks = {"tokenize": (student.encode_batch, docs)}
        for how, pairs in calls.items():
            tasks[f"vectorized {how}"] = (align_all, align, pairs)
            tasks[f"python {how}"] = (align_all, align_python, pairs)
        wall, cpu = interleaved_best_times(args.repeats, tasks)
        for how in calls:
            vectorized, python = cpu[f"vectorized {how}"], cpu[f"python {how}"]
            print(
                f"{name:<10} {how:<14} {n_student / vectorized:>17,.0f} "
                f"{n_student / python:>13,.0f} {python / vectorized:>7.1f}x "
                f"{n_student / wall['tokenize']:>15,.0f} "
                f"{100 * wall[f'vectorized {how}'] / wall['tokenize']:>16.2f}%"
            )
    print()
    print("targets: speedup >= 20x, align / tokenize <= 5%")
    print_load_average()


if __name__ == "__main__":
    main()
