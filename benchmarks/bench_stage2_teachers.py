"""What does reading several teachers' caches cost the data path (--more-caches,
docs/several-teachers.md)? One data-loader worker's rate with 1, 2 and 3 caches of one corpus, as
a ratio to one cache, measured in turn in one run.

Caches of the shipped GSM-style corpus by teachers of three tokenizers (qwen2.5, smollm2,
deepseek; seeded random losses: the cost does not depend on their values), streamed by one
consumer exactly as a worker does (bench_stage2_data.steady_epoch: one epoch in steady state,
student targets delivered per second). Each extra cache adds its Parquet read, its row checks and
its alignment; the student tokenizes each text once. With --topk K the caches hold the
teacher's top-K view and the plans distill (`--guidance uld`, one term per teacher,
pipeline.distillation.teachers): each extra cache then also adds its top-k columns and extras.

    python benchmarks/bench_stage2_teachers.py [--docs 2000] [--student tinyllama] [--topk 32]
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers starts its thread pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the cache builder

from bench_stage2_data import steady_epoch  # noqa: E402
from timing import best_times, print_header, print_load_average  # noqa: E402

from pipeline.cache.manifest import load_manifest  # noqa: E402
from pipeline.distillation.teachers import mixture  # noqa: E402
from pipeline.distillation.uld import UniversalLogitDistillation  # noqa: E402
from stage2_train.data.more_teachers import teacher_caches  # noqa: E402
from stage2_train.data.plan import DataPlan  # noqa: E402
from tests.cache_fixtures import build_cache, corpus_documents  # noqa: E402

TEACHERS = ("qwen2.5", "smollm2", "deepseek")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=2000, help="documents in each cache")
    parser.add_argument("--student", default="tinyllama", help="student tokenizer")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure (best kept)")
    parser.add_argument("--topk", type=int, default=0, help="top-K columns, distilled (0: none)")
    args = parser.parse_args()

    documents = corpus_documents(args.docs)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(tmp) / teacher for teacher in TEACHERS]
        for seed, (folder, teacher) in enumerate(zip(folders, TEACHERS, strict=True)):
            build_cache(folder, teacher_tokenizer=teacher, documents=documents, seed=seed,
                        docs_per_shard=max(1, args.docs // 4), topk=args.topk)  # fmt: skip
        manifests = {folder: load_manifest(folder) for folder in folders}
        plans = {}
        for count in range(1, len(folders) + 1):
            more = {folder: manifests[folder] for folder in folders[1:count]}
            plans[count] = DataPlan.from_cache(
                folders[0],
                student_tokenizer=args.student,
                seq_len=args.seq_len,
                micro_batch_size=args.micro_batch_size,
                more_caches=teacher_caches(folders[0], manifests[folders[0]], more, lambda t: "token"),
                distillation=mixture([UniversalLogitDistillation()] * count) if args.topk else None,
            )  # fmt: skip
        times = {count: [] for count in plans}
        tokens = {}
        for _ in range(args.repeats):  # in turn, so that every count sees the same machine load
            for count, plan in plans.items():
                tokens[count], took = steady_epoch(plan)
                times[count].append(took)
    wall, cpu = best_times(times)
    print(
        f"{args.docs} documents per cache, teachers {', '.join(TEACHERS)}, student "
        f"{args.student}; documents packing {args.micro_batch_size} x {args.seq_len}; one "
        f"thread per tokenizer; best of {args.repeats}"
        + (f"; top-{args.topk} columns, --guidance uld from each cache" if args.topk else "")
    )
    print()
    print_header(f"{'caches':<8} {'tokens/s':>10} {'relative':>9} {'tokens/CPU-s':>13} "
                 f"{'relative':>9} {'median pair':>12}")  # fmt: skip
    for count in plans:
        by_wall, by_cpu = tokens[count] / wall[count], tokens[count] / cpu[count]
        # each round's timings ran back to back: the median of their ratios is the steadier one
        pairs = [(tokens[count] / b.cpu) / (tokens[1] / a.cpu)
                 for a, b in zip(times[1], times[count], strict=True)]  # fmt: skip
        print(
            f"{count:<8} {by_wall:>10,.0f} {by_wall / (tokens[1] / wall[1]):>8.3f}x "
            f"{by_cpu:>13,.0f} {by_cpu / (tokens[1] / cpu[1]):>8.3f}x "
            f"{statistics.median(pairs):>11.3f}x"
        )
    print_load_average()


if __name__ == "__main__":
    main()
