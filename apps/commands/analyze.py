"""`vocagno analyze overlap|chunks|curves|selection`: the paper's analyses as tables and PNG
figures, and what teacher-guided selection keeps for a given student."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from apps.commands.subcommand import config_from_args, config_subcommand
from pipeline.config import from_dict

SECTION = "analyze"


def _overlap(args: argparse.Namespace) -> int:
    from apps.analysis.vocabulary_overlap import MARKDOWN_NAME, PNG_NAME, run_vocabulary_overlap

    config = config_from_args(args)
    report = run_vocabulary_overlap(config)
    for row in report["rows"]:
        print(
            f"{row['teacher']:>12}: {row['shared']:>6} shared, "
            f"{100 * row['shared_over_teacher']:6.2f}% of teacher, "
            f"{100 * row['shared_over_student']:6.2f}% of student"
        )
    print(f"wrote {config.out / MARKDOWN_NAME} and {config.out / PNG_NAME}")
    return 0


def _chunks(args: argparse.Namespace) -> int:
    from apps.analysis.chunk_overlap import MARKDOWN_NAME, PNG_NAME, run_chunk_overlap

    config = config_from_args(args)
    report = run_chunk_overlap(config)
    token = report["token_level"]
    for row in report["chunks"]:
        print(f"{row['num_chunks']:>5} chunks  IoU {_pct(row['iou'])}  IoS {_pct(row['ios'])}")
    print(f"token-level  IoU {_pct(token['iou'])}  IoS {_pct(token['ios'])}")
    if report["skipped"]:
        print(f"{len(report['skipped'])} malformed records skipped (listed in the JSON)")
    print(f"wrote {config.out / MARKDOWN_NAME} and {config.out / PNG_NAME}")
    return 0


def _curves(args: argparse.Namespace) -> int:
    from apps.analysis.configs import TrainingCurvesConfig
    from apps.analysis.training_curves import plot_training_curves

    config = from_dict(TrainingCurvesConfig, {"run_dirs": args.run_dirs, "out": args.out})
    for run in plot_training_curves(config):
        if run.warning:
            print(f"vocagno analyze curves: warning: {run.warning}", file=sys.stderr)
        print(f"{run.run_dir}: {run.steps} steps")
    print(f"wrote {config.out}")
    return 0


def _selection(args: argparse.Namespace) -> int:
    from apps.analysis.selection import (
        JSON_NAME,
        MARKDOWN_NAME,
        run_selection_report,
        summary_lines,
    )

    config = config_from_args(args)
    report = run_selection_report(config)
    for line in summary_lines(report["statistics"]):
        print(line)
    print(f"wrote {config.out / JSON_NAME} and {config.out / MARKDOWN_NAME}")
    return 0


def _pct(value: float | None) -> str:
    return "   n/a" if value is None else f"{100 * value:5.1f}%"


def add_parser(subparsers) -> None:
    from apps.analysis.configs import (
        ChunkOverlapConfig,
        SelectionConfig,
        TrainingCurvesConfig,
        VocabularyOverlapConfig,
    )

    parser = subparsers.add_parser(
        "analyze",
        help="the paper's analyses (vocabulary overlap, chunk overlap, training curves) and what "
        "guidance selects",
        description="The paper's analyses as tables and PNG figures.",
    )
    analyses = parser.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    config_subcommand(
        analyses,
        "overlap",
        VocabularyOverlapConfig,
        SECTION,
        "Vocabulary overlap of each teacher tokenizer with the student's (paper Figure 1): "
        "shared token strings as a share of each vocabulary. Writes vocab_overlap.json, .csv, "
        ".md and .png into --out.",
        _overlap,
    )
    config_subcommand(
        analyses,
        "chunks",
        ChunkOverlapConfig,
        SECTION,
        "Character IoU/IoS of equal-chunk alignment against the number of chunks, with "
        "token-level lexical alignment as the reference (paper Figures 3 and 6). Writes "
        "chunk_overlap.json, .md and .png into --out.",
        _chunks,
    )
    config_subcommand(
        analyses,
        "selection",
        SelectionConfig,
        SECTION,
        "What teacher-guided selection keeps for this student, on stage 2's own micro-batches of "
        "the cache: the share of the student's loss the kept tokens carry against a random "
        "selection of the same size, the rank correlation of excess loss with the student's and "
        "the teacher's loss, and the frequent token types that are (almost) never kept. Writes "
        "selection.json and .md into --out (docs/analysis.md).",
        _selection,
    )

    # By hand: its run folders are positional, which build_parser (flags only) cannot express.
    fields = {f.name: f for f in dataclasses.fields(TrainingCurvesConfig)}
    curves = analyses.add_parser(
        "curves",
        help="training curves of runs from their metrics.jsonl",
        description="Training curves from each run's metrics.jsonl: loss_all and loss over kept "
        "tokens against training tokens, and the kept/mapped fractions, one colour per run "
        "(labelled by folder name). A partly written last line (a run in progress) is skipped "
        "with a warning.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    curves.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help=fields["run_dirs"].metadata["help"],
    )
    curves.add_argument(
        "--out", type=Path, default=fields["out"].default, help=fields["out"].metadata["help"]
    )
    curves.set_defaults(func=_curves)
