"""`vocagno cache verify|stats|inspect DIR`: audit, summarize, or look inside a stage-1 cache."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.option_values import finite_float
from pipeline.storage.store import location_argument

CACHE_HELP = (
    "cache folder (with manifest.json), or its URI in object storage (s3://bucket/prefix, gs://…; "
    "credentials and endpoint from the environment)"
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "cache",
        help="verify or summarize a stage-1 teacher-loss cache",
        description="Audit (verify) or summarize (stats) a cache written by stage1_score/run.py.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify",
        help="check every shard against the manifest; exit 1 naming each bad shard",
        description="Check the manifest, that every listed shard is present with its size and "
        "sha256, that no unlisted shard or temporary file is there, and inside each shard the "
        "schema, row and token counts, list lengths, text hashes and token offsets.",
    )
    verify.add_argument("cache_dir", type=location_argument, metavar="DIR", help=CACHE_HELP)
    verify.add_argument("--quiet", action="store_true", help="print only problems and the verdict")
    verify.set_defaults(func=run_verify)
    stats = actions.add_parser(
        "stats",
        help="documents, tokens, loss distribution, bytes per token, teacher and tokenizer",
        description="Summarize a cache: documents, teacher tokens, loss mean and percentiles, "
        "share of unscored (NaN) tokens, bytes per token with and without the text column.",
    )
    stats.add_argument("cache_dir", type=location_argument, metavar="DIR", help=CACHE_HELP)
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    stats.set_defaults(func=run_stats)
    _add_inspect(actions)


def _add_inspect(actions) -> None:
    from pipeline.alignment import DEFAULT_AGGREGATION
    from pipeline.choices import AGGREGATIONS, UNMAPPED_STRATEGIES
    from pipeline.guidance import DEFAULT_GUIDANCE

    inspect = actions.add_parser(
        "inspect",
        help="an HTML page of one document's student tokens under teacher guidance (Figure 8)",
        description="Tokenize one cached document with the student's tokenizer, align it to the "
        "cached teacher tokens, and write an HTML page: each student token shaded by its excess "
        "loss (student - teacher), marked kept or dropped by the top-k selection, with the "
        "teacher tokens it maps to. Needs the student model (for its loss), never the teacher.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    inspect.add_argument("cache_dir", type=location_argument, metavar="DIR", help=CACHE_HELP)
    inspect.add_argument("--student", required=True, help="student model folder or hub id")
    inspect.add_argument(
        "--student-tokenizer", default=None, help="student tokenizer (default: the student's own)"
    )
    which = inspect.add_mutually_exclusive_group()
    which.add_argument("--doc-id", default=None, help="the document's doc_id")
    which.add_argument("--index", type=int, default=0, help="the document's position in the cache")
    inspect.add_argument(
        "--topk", type=finite_float, default=DEFAULT_GUIDANCE.topk,
        help="fraction of mapped tokens kept",
    )
    inspect.add_argument(
        "--unmapped", choices=UNMAPPED_STRATEGIES, default=DEFAULT_GUIDANCE.unmapped
    )
    inspect.add_argument("--aggregate", choices=AGGREGATIONS, default=DEFAULT_AGGREGATION)
    inspect.add_argument("--out", type=Path, default=Path("inspect.html"), help="HTML file")
    inspect.set_defaults(func=run_inspect)


def run_verify(args: argparse.Namespace) -> int:
    from pipeline.cache.verify import verify_cache

    def on_shard(record, problem) -> None:
        if problem is None and not args.quiet:
            print(f"ok    {record.file}  rows={record.rows} tokens={record.teacher_tokens}")

    manifest, problems = verify_cache(args.cache_dir, on_shard)
    for problem in problems:
        print(f"FAIL  {problem}", flush=True)
    verdict = (
        f"{args.cache_dir}: {len(manifest.shards)} shards, {manifest.total_rows} documents, "
        f"{manifest.total_teacher_tokens} teacher tokens"
    )
    if problems:
        print(f"{verdict}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{verdict}: all verified")
    return 0


def run_stats(args: argparse.Namespace) -> int:
    from pipeline.cache.stats import cache_stats

    stats = cache_stats(args.cache_dir)
    if args.json:
        print(json.dumps(stats.to_json(), indent=2, sort_keys=True))
        return 0
    teacher = stats.teacher
    print(f"cache            {args.cache_dir}")
    print(
        f"teacher          {teacher.get('name', teacher)} ({teacher.get('backend', '?')}, {teacher.get('dtype', '?')})"
    )
    print(f"tokenizer        {stats.tokenizer.get('fingerprint', stats.tokenizer)}")
    print(f"shards           {stats.shards}")
    unscored = (
        f"; {stats.unscored_documents} with no scored teacher token"
        if stats.unscored_documents
        else ""
    )
    print(f"documents        {stats.documents} (+{stats.skipped} skipped{unscored})")
    print(f"teacher tokens   {stats.teacher_tokens} ({stats.nan_fraction:.2%} unscored, NaN)")
    percentiles = "  ".join(f"{k}={v:.3f}" for k, v in stats.loss_percentiles.items())
    print(f"loss (nats)      mean={stats.loss_mean:.4f}  {percentiles}")
    print(
        f"bytes            {stats.bytes} ({stats.bytes_per_token:.2f}/token; "
        f"{stats.bytes_per_token_without_text:.2f}/token without the text column)"
    )
    columns = "  ".join(f"{k}={v:.3f}" for k, v in stats.column_bytes_per_token.items())
    print(f"bytes/token      {columns}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from apps.analysis.guidance_page import find_document, guided_tokens, write_guidance_page
    from pipeline.errors import ConfigError
    from pipeline.guidance import GuidanceSettings
    from pipeline.models.student import load_trained_student
    from pipeline.tokenizer import load_tokenizer

    if args.out.is_dir():  # before any work: the page's write would fail at the end
        raise ConfigError(f"--out {args.out} is a folder; give the HTML file to write")
    try:
        settings = GuidanceSettings(mode="token", topk=args.topk, unmapped=args.unmapped)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    document = find_document(args.cache_dir, args.doc_id, args.index)
    model = load_trained_student(args.student)
    tokenizer = load_tokenizer(args.student_tokenizer or args.student)
    tokens = guided_tokens(document, model, tokenizer, settings, args.aggregate)
    title = f"{Path(args.student).name}: teacher guidance on {document.doc_id}"
    write_guidance_page(args.out, document, tokens, title)
    kept, valid = int(tokens["kept"].sum()), int(tokens["valid"].sum())
    print(f"wrote {args.out}: {document.doc_id}, {kept} of {valid} student tokens kept")
    return 0
