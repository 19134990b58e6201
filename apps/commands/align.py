"""`vocagno align`: show how each student token maps to teacher tokens (paper Algorithm 1).

Default output, one JSON object per document and per line (other tools parse it; keep it stable):
  {"student": {"ids", "start", "end"}, "teacher": {"ids", "start", "end"},
   "map_start": [...], "map_end": [...]}
with character offsets (Python str indices, end exclusive) and the inclusive teacher range of each
student token, -1 where unmapped. `--human` prints a table instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator

from apps.commands.subcommand import tokenizer_pair_subcommand
from pipeline.corpus.records import surrogate_problem
from pipeline.errors import ConfigError

_BATCH_DOCS = 64  # documents tokenized per encode_batch call


def add_parser(subparsers) -> None:
    from pipeline.choices import ON_BAD_RECORD

    parser = tokenizer_pair_subcommand(
        subparsers,
        "align",
        "map each student token to its teacher token range (JSON lines or a table)",
        __doc__,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", metavar="STR", help="align this one text")
    source.add_argument(
        "--input",
        metavar="FILE",
        help="JSON lines (plain or .zst), one document per line, streamed; also Parquet, text "
        "files or a folder of them (any corpus stage 1 reads)",
    )
    parser.add_argument(
        "--text-column",
        default="text",
        help="field holding each document's text in --input (default: text)",
    )
    parser.add_argument(
        "--on-bad-record",
        choices=ON_BAD_RECORD,
        default="error",
        help="a malformed --input record stops with an error naming file and record (default), "
        "or with 'skip' is reported on stderr and left out",
    )
    parser.add_argument(
        "--no-bos",
        action="store_true",
        help="do not prepend BOS, even for families whose policy adds one (Llama, Mistral, "
        "DeepSeek); by default each side is framed as its family expects",
    )
    parser.add_argument(
        "--eos", action="store_true", help="append each tokenizer's EOS (zero-width, unmapped)"
    )
    parser.add_argument(
        "--human", action="store_true", help="print a readable table instead of JSON lines"
    )
    parser.set_defaults(func=run)


def _texts(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(label, text) of each document, streamed."""
    if args.text is not None:
        if problem := surrogate_problem(args.text, "--text"):
            raise ConfigError(problem)
        yield "--text", args.text
        return
    from pipeline.cache.manifest import SkippedDocument
    from pipeline.corpus import Corpus, CorpusOptions

    corpus = Corpus(
        args.input, CorpusOptions(text_column=args.text_column, on_bad_record=args.on_bad_record)
    )
    for doc in corpus:
        if isinstance(doc, SkippedDocument):
            print(
                f"vocagno align: skipped {doc.source} record {doc.record}: {doc.reason}",
                file=sys.stderr,
            )
            continue
        yield doc.doc_id, doc.text


def run(args: argparse.Namespace) -> int:
    from pipeline.alignment import align
    from pipeline.tokenizer import load_tokenizer

    student = load_tokenizer(args.student_tokenizer)
    teacher = load_tokenizer(args.teacher_tokenizer)
    framing = {"add_bos": False if args.no_bos else None, "add_eos": args.eos}
    documents = _texts(args)
    number = 0
    while batch := list(itertools.islice(documents, _BATCH_DOCS)):
        labels, texts = zip(*batch, strict=True)
        pairs = zip(
            student.encode_batch(list(texts), **framing),
            teacher.encode_batch(list(texts), **framing),
            strict=True,
        )
        for label, text, (s, t) in zip(labels, texts, pairs, strict=True):
            number += 1
            map_start, map_end = align(s.start, s.end, t.start, t.end)
            if args.human:
                print(_table(number, label, text, student, s, teacher, t, map_start, map_end))
            else:
                print(json.dumps(_record(s, t, map_start, map_end), separators=(",", ":")))
        sys.stdout.flush()
    return 0


def _record(s, t, map_start, map_end) -> dict:
    def side(enc) -> dict:
        return {"ids": enc.ids.tolist(), "start": enc.start.tolist(), "end": enc.end.tolist()}

    return {
        "student": side(s),
        "teacher": side(t),
        "map_start": map_start.tolist(),
        "map_end": map_end.tolist(),
    }


def _table(number, label, text, student, s, teacher, t, map_start, map_end) -> str:
    def quoted(start, end) -> str:
        return json.dumps(text[start:end], ensure_ascii=False)

    unmapped = int((map_start < 0).sum())
    lines = [
        f"# document {number} ({label}): {len(s)} student tokens ({student.spec}), "
        f"{len(t)} teacher tokens ({teacher.spec}), {unmapped} unmapped",
        f"{'i':>5}  {'piece':<14} {'text':<14} {'span':<11} {'teacher':<11} teacher text",
    ]
    for i, (token_id, start, end, j, k) in enumerate(
        zip(
            s.ids.tolist(),
            s.start.tolist(),
            s.end.tolist(),
            map_start.tolist(),
            map_end.tolist(),
            strict=True,
        )
    ):
        piece = student.backend.id_to_token(token_id)
        if j < 0:
            where, covered = "-", "(unmapped)"
        else:
            where = str(j) if j == k else f"{j}..{k}"
            covered = " ".join(
                quoted(a, b)
                for a, b in zip(t.start[j : k + 1].tolist(), t.end[j : k + 1].tolist(), strict=True)
            )
        span = f"{start}-{end}"
        lines.append(
            f"{i:>5}  {piece:<14} {quoted(start, end):<14} {span:<11} {where:<11} {covered}"
        )
    return "\n".join(lines)
