"""How much of stage 1's forward pass is real tokens: real tokens / computed slots (padding
included) with `--row-packing padded` and `packed`, from the plan alone (no model runs).

    python benchmarks/bench_stage1_packing.py [--champ champ_dataset-1.0.0-py3-none-any.whl]

Each corpus is tokenized with a shipped tokenizer (qwen2.5, bench_gpu.py's teachers'), cut into
units of --docs-per-shard documents as the job does, and each unit's windows planned into
batches exactly as pipeline.scoring.hf plans them (`HFScorer.layouts`): padded, a window per row
of the batch's longest; packed, windows sharing rows of --max-length tokens. Corpora: the shipped
training split (GSM8K-style word problems, 20,000 documents) and, with --champ, the 270 problems
of CHAMP (competition mathematics; each document its problem, solution steps and answer) read
from the champ-dataset 1.0.0 wheel (`pip download champ-dataset==1.0.0 --no-deps`).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from pipeline.corpus import Corpus, CorpusOptions  # noqa: E402
from pipeline.scoring.batching import packed_layouts, padded_layouts  # noqa: E402
from pipeline.scoring.windows import plan_document_windows  # noqa: E402
from pipeline.shipped import shipped_corpus  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402

CHAMP_PROBLEMS = "champ_dataset/dataset_files/v0.json"


def champ_texts(wheel: Path) -> list[str]:
    """CHAMP's problems as documents: the problem, its solution's steps, its answer."""
    with zipfile.ZipFile(wheel) as archive:
        problems = json.loads(archive.read(CHAMP_PROBLEMS))["problems"]
    texts = []
    for problem in problems.values():
        solution = problem["solution"]
        if isinstance(solution, str):  # stored as a Python literal
            solution = ast.literal_eval(solution)
        steps = "\n".join(step["_text"] for step in solution["steps"])
        texts.append(
            f"Problem: {problem['_text']}\nSolution: {steps}\nAnswer: {problem['_answer']}"
        )
    return texts


def slots(lengths: list[int], args) -> dict[str, int]:
    """{"tokens": real, "padded": slots, "packed": slots} of one unit's batches."""
    windows = plan_document_windows(lengths, args.max_length, args.stride)
    return {
        "tokens": int(windows.length.sum()),
        "padded": sum(b.slots for b in padded_layouts(windows.length, args.batch_tokens)),
        "packed": sum(
            b.slots for b in packed_layouts(windows.length, args.max_length, args.batch_tokens)
        ),
    }


def report(name: str, texts: list[str], args) -> None:
    tokenizer = load_tokenizer(args.tokenizer)
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    totals = {"tokens": 0, "padded": 0, "packed": 0}
    for begin in range(0, len(lengths), args.docs_per_shard):
        for key, value in slots(lengths[begin : begin + args.docs_per_shard], args).items():
            totals[key] += value
    print(
        f"{name}: {len(texts):,} documents, median {int(np.median(lengths))} tokens "
        f"(max {max(lengths):,}), {totals['tokens']:,} window tokens"
    )
    for layout in ("padded", "packed"):
        print(
            f"  {layout:7s} {totals[layout]:>12,} slots: real tokens / slots "
            f"{totals['tokens'] / totals[layout]:.4f}, slots / real tokens "
            f"{totals[layout] / totals['tokens']:.4f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--champ", type=Path, help="the champ-dataset 1.0.0 wheel")
    parser.add_argument("--docs", type=int, help="the first N training documents (default all)")
    parser.add_argument("--tokenizer", default="qwen2.5")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--stride", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--docs-per-shard", type=int, default=1000)
    args = parser.parse_args(argv)
    print(
        f"tokenizer {args.tokenizer}, max length {args.max_length}, stride {args.stride}, "
        f"{args.batch_tokens} tokens per batch, units of {args.docs_per_shard} documents"
    )
    documents = Corpus(shipped_corpus("train"), CorpusOptions(id_column="id"))
    texts = [d.text for d, _ in zip(documents, range(args.docs or 10**9), strict=False)]
    report("shipped training split", texts, args)
    if args.champ is not None:
        report("CHAMP", champ_texts(args.champ), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
