"""`vocagno eval`: held-out bits per character and answer accuracy of any student or teacher."""

from __future__ import annotations

import argparse
import json

from apps.evaluation.config import SECTION, EvalConfig
from pipeline.config import build_parser, config_from_options

DESCRIPTION = (
    "Evaluate a causal LM: held-out loss in bits per character (comparable across tokenizers) and "
    "math answer accuracy by greedy generation with a few-shot prompt. Prints a JSON summary."
)


def add_parser(subparsers) -> None:
    options = build_parser(EvalConfig, DESCRIPTION, SECTION)
    parser = subparsers.add_parser(
        "eval",
        parents=[options],
        add_help=False,
        help="bits per character and answer accuracy of a model",
        description=DESCRIPTION,
        formatter_class=options.formatter_class,
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from apps.evaluation.run import evaluate

    given = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    report = evaluate(config_from_options(EvalConfig, given, SECTION))
    summary = {k: v for k, v in report.items() if k != "config"}
    if "answer_accuracy" in summary:
        summary["answer_accuracy"] = {
            k: v for k, v in summary["answer_accuracy"].items() if k != "outcomes"
        }
    print(json.dumps(summary, indent=2))
    return 0
