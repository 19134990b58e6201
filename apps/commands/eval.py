"""`vocagno eval`: held-out bits per character and answer accuracy of any student or teacher."""

from __future__ import annotations

import argparse
import json

from apps.commands.subcommand import config_from_args, config_subcommand
from apps.evaluation.config import SECTION, EvalConfig

DESCRIPTION = (
    "Evaluate a causal LM. By default: the primary metric, answer bits per character given the "
    "question on 200 held-out problems; held-out bits per character of 200 documents (both "
    "comparable across tokenizers); and math answer accuracy by greedy generation with a "
    "few-shot prompt. Prints a JSON summary."
)


def add_parser(subparsers) -> None:
    config_subcommand(
        subparsers,
        "eval",
        EvalConfig,
        SECTION,
        DESCRIPTION,
        _run,
        help="answer bits per character (primary), bits per character and answer accuracy",
    )


def _run(args: argparse.Namespace) -> int:
    from apps.evaluation.run import evaluate

    report = evaluate(config_from_args(args))
    summary = {k: v for k, v in report.items() if k != "config"}
    if "answer_accuracy" in summary:
        summary["answer_accuracy"] = {
            k: v for k, v in summary["answer_accuracy"].items() if k != "outcomes"
        }
    print(json.dumps(summary, indent=2))
    return 0
