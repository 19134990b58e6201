"""What does --eval-every cost? One held-out evaluation (stage2_train.evaluation.evaluate on the
first --eval-docs documents of the shipped eval split, as stage 2 runs it) beside one optimizer
step without it (forward-backward over the step's micro-batches from a real data path, then
AdamW), timed in turn, best of --repeats each; then the evaluation's cost spread over the steps
between two evaluations, for several N, as a share of a step. Last, the check that no held-out
document is in the cache, once before the first step: its reading of the text_sha256 column, on
--check-rows synthetic hashes written as stage 1 writes them, in rows per second.

    python benchmarks/bench_stage2_eval.py [--preset llama-small] [--seq-len 512] [--every 100 500]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the cache builder

from timing import interleaved_best_times, print_header, print_load_average  # noqa: E402

from pipeline.cache.manifest import ShardRecord  # noqa: E402
from pipeline.cache.schema import TEXT_SHA256  # noqa: E402
from pipeline.cross_entropy import token_loss  # noqa: E402
from pipeline.models.student import build_student  # noqa: E402
from pipeline.shipped import shipped_corpus  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage2_train.attention import student_logits  # noqa: E402
from stage2_train.data.heldout import check_unseen, read_heldout  # noqa: E402
from stage2_train.data.plan import DataPlan  # noqa: E402
from stage2_train.data.streams import consumer_stream  # noqa: E402
from stage2_train.distributed import Runtime  # noqa: E402
from stage2_train.evaluation import evaluate  # noqa: E402
from tests.cache_fixtures import build_cache  # noqa: E402

CPU = torch.device("cpu")


def training_step(model, optimizer, micro_batches: list[dict]) -> None:
    """Forward-backward over each micro-batch (the mean over its targets), then AdamW."""
    for batch in micro_batches:
        loss = token_loss(student_logits(model, batch, CPU), batch["labels"])
        (loss.sum() / (batch["labels"] >= 0).sum().clamp(min=1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def hash_scan_seconds(heldout, rows: int) -> float:
    """Seconds check_unseen takes over one shard of `rows` hashes (PLAIN, zstd 9, no dictionary:
    pipeline.cache.schema's settings for the column)."""
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(rows)]
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(pa.table({TEXT_SHA256: digests}), Path(tmp) / "shard.parquet",
                       compression="zstd", compression_level=9, use_dictionary=False,
                       column_encoding={TEXT_SHA256: "PLAIN"}, write_statistics=False)  # fmt: skip
        shards = [ShardRecord(0, "shard.parquet", rows, 0, 0, "")]
        started = time.perf_counter()
        check_unseen(heldout, Path(tmp), shards, 0, 1, lambda found: [found])
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-small", help="student preset")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--eval-docs", type=int, default=200, help="stage 2's --eval-docs")
    parser.add_argument("--every", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--repeats", type=int, default=3, help="timings of each (best kept)")
    parser.add_argument("--check-rows", type=int, default=2_000_000, help="hashes scanned")
    args = parser.parse_args()

    tokenizer = load_tokenizer("tinyllama")
    with tempfile.TemporaryDirectory() as tmp:
        build_cache(Path(tmp), num_documents=64, docs_per_shard=64)
        plan = DataPlan.from_cache(Path(tmp), student_tokenizer="tinyllama", seq_len=args.seq_len,
                                   micro_batch_size=args.micro_batch_size)  # fmt: skip
        stream = iter(consumer_stream(plan, 0))
        micro_batches = [next(stream) for _ in range(args.accumulation)]
    heldout = read_heldout(str(shipped_corpus("eval")), args.eval_docs, tokenizer, args.seq_len,
                           args.micro_batch_size)  # fmt: skip
    model = build_student(args.preset, tokenizer, seed=0, seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runtime = Runtime(0, 0, 1, CPU)
    tasks = {
        "step": (training_step, model, optimizer, micro_batches),
        "evaluation": (evaluate, model, heldout, runtime, contextlib.nullcontext, "plain"),
    }
    training_step(model, optimizer, micro_batches)  # warm-up
    wall, cpu = interleaved_best_times(args.repeats, tasks)

    params = sum(p.numel() for p in model.parameters())
    print(
        f"student {args.preset} ({params / 1e6:.1f}M parameters), a step of {args.accumulation} "
        f"x {args.micro_batch_size} x {args.seq_len} tokens; held-out: {heldout.documents} "
        f"documents of the shipped eval split, {heldout.tokens:,} scored tokens in "
        f"{len(heldout.batches)} batches of {args.micro_batch_size} x {args.seq_len}; "
        f"{torch.get_num_threads()} torch threads, best of {args.repeats}"
    )
    print()
    print(f"one step without eval:  {wall['step']:8.3f} s wall {cpu['step']:8.3f} s CPU")
    print(f"one evaluation:         {wall['evaluation']:8.3f} s wall "
          f"{cpu['evaluation']:8.3f} s CPU = {wall['evaluation'] / wall['step']:.2f} steps")  # fmt: skip
    print()
    print_header(f"{'--eval-every':>12} {'eval s / step':>14} {'CPU s / step':>13} "
                 f"{'step with eval / without':>25} {'by CPU':>8}")  # fmt: skip
    for every in args.every:
        spread, cpu_spread = wall["evaluation"] / every, cpu["evaluation"] / every
        print(f"{every:>12} {spread:>14.4f} {cpu_spread:>13.4f} "
              f"{(wall['step'] + spread) / wall['step']:>24.4f}x "
              f"{(cpu['step'] + cpu_spread) / cpu['step']:>7.4f}x")  # fmt: skip
    print()
    scan = hash_scan_seconds(heldout, args.check_rows)
    print(f"the held-out check read {args.check_rows:,} cache hashes in {scan:.2f} s wall: "
          f"{args.check_rows / scan:,.0f} rows/s")  # fmt: skip
    print_load_average()


if __name__ == "__main__":
    main()
