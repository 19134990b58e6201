"""1 vs 2 Ray workers on this machine: the same stage-1 job (same corpus, same teacher) run with
one worker using every CPU and with two workers splitting them, in one local Ray instance.

Usage: python benchmarks/bench_stage1_workers.py [--teacher DIR] [--docs N] [--cpus C]
Wall time includes starting the actors and loading the teacher in each (what a user waits for);
the unit seconds reported by the workers give the steady-state rate without that start-up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stage1_runs import add_stage1_arguments, prepared_teacher, timed_stage1, write_corpus_slice  # noqa: E402

from pipeline.log import configure  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stage1_arguments(parser)
    args = parser.parse_args()
    configure()  # the teacher's preparation reports its steps
    args.teacher = prepared_teacher(args.teacher)
    import ray

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        corpus = write_corpus_slice(Path(scratch), args.docs)
        for workers in (1, 2):
            out = Path(scratch) / f"cache-{workers}"
            command = [
                "--teacher", args.teacher, "--corpus", str(corpus), "--out", str(out),
                "--id-column", "id", "--docs-per-shard", str(args.docs_per_shard),
                "--max-length", "512", "--stride", "256", "--batch-tokens", "4096",
                "--num-workers", str(workers), "--progress-seconds", "1e9",
            ]  # fmt: skip
            wall, manifest, per_worker = timed_stage1(command)
            tokens = manifest["totals"]["teacher_tokens"]
            results[workers] = (wall, tokens, per_worker, manifest["shards"])
    ray.shutdown()
    print(f"{args.docs} documents, teacher {args.teacher}, {args.cpus} CPUs")
    for workers, (wall, tokens, per_worker, _) in results.items():
        print(
            f"{workers} worker(s) x {args.cpus // workers} CPU(s): wall {wall:6.1f} s -> "
            f"{tokens / wall:7.1f} tokens/s end to end; steady state {sum(per_worker):7.1f} "
            f"tokens/s ({' + '.join(f'{r:.0f}' for r in per_worker)})"
        )
    one, two = results[1], results[2]
    print(f"2 workers / 1 worker: end to end {one[0] / two[0]:.2f}x, steady state "
          f"{sum(two[2]) / sum(one[2]):.2f}x")  # fmt: skip
    same = [a["sha256"] == b["sha256"] for a, b in zip(one[3], two[3], strict=True)]
    print(f"shards byte-identical between the two runs: {sum(same)}/{len(same)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
