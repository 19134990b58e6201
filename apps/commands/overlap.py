"""`vocagno overlap`: vocabulary overlap of two tokenizers as in the paper's Figure 1.

Prints one JSON object (other tools parse it; keep it stable):
  {"shared", "student_vocab", "teacher_vocab", "shared_over_teacher", "shared_over_student"}
where a token is shared when the same token string is in both vocabularies (added tokens
included); Qwen2.5 as teacher and TinyLlama as student give shared_over_teacher = 0.0632.
"""

from __future__ import annotations

import argparse
import json

from apps.commands.subcommand import tokenizer_pair_subcommand


def add_parser(subparsers) -> None:
    tokenizer_pair_subcommand(
        subparsers,
        "overlap",
        "vocabulary overlap of a student and a teacher tokenizer (paper Figure 1), as JSON",
        __doc__,
    ).set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.tokenizer import load_tokenizer
    from pipeline.vocab_overlap import vocabulary_overlap

    overlap = vocabulary_overlap(
        load_tokenizer(args.student_tokenizer), load_tokenizer(args.teacher_tokenizer)
    )
    print(json.dumps(overlap.to_dict()))
    return 0
