"""How much of the teacher's next-token distribution does a cached top-K leave out? The mass
outside the K (`topk_rest`, docs/cache-columns.md) is what ULD and KLD see only as one bucket
(docs/distillation.md). Reads a cache made with `--topk-probs K` and prints, for K and the smaller
K' it can cut from the stored top K (rest at K' = rest + the probabilities at ranks K'+1..K), the
mean, median and upper percentiles of the missing mass over every scored teacher token, and the
share of tokens missing more than 10% and 50%.

    python benchmarks/bench_topk_missing_mass.py --cache DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cache.manifest import load_manifest  # noqa: E402
from pipeline.cache.rows import token_values  # noqa: E402
from pipeline.cache.schema import TOPK_PROBS, TOPK_REST, iter_shard_batches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="a --topk-probs cache folder")
    args = parser.parse_args()
    manifest = load_manifest(args.cache)
    k = manifest.settings.topk_probs
    if not k:
        sys.exit(f"{args.cache} has no top-k columns: score it with stage 1's --topk-probs K")
    probs, rest, documents = [], [], 0
    for shard in manifest.shards:
        for batch in iter_shard_batches(args.cache / shard.file, [TOPK_PROBS, TOPK_REST], 512):
            documents += batch.num_rows
            scored = ~np.isnan(token_values(batch, TOPK_REST))
            probs.append(token_values(batch, TOPK_PROBS)[scored].astype(np.float64))
            rest.append(token_values(batch, TOPK_REST)[scored].astype(np.float64))
    probs, rest = np.concatenate(probs), np.concatenate(rest)
    print(
        f"{args.cache}: teacher {manifest.teacher.get('name', manifest.teacher.get('id'))}, {documents} "
        f"documents, {rest.size:,} scored teacher tokens, stored top-{k}"
    )
    print()
    header = f"{'K':>4} {'mean':>8} {'median':>8} {'p90':>8} {'p99':>8} {'> 0.1':>7} {'> 0.5':>7}"
    print(header)
    print("-" * len(header))
    for cut in sorted({c for c in (1, 4, 8, 16, 32, 64, 128) if c < k} | {k}):
        missing = rest + probs[:, cut:].sum(1)
        p50, p90, p99 = np.percentile(missing, [50, 90, 99])
        print(
            f"{cut:>4} {missing.mean():>8.4f} {p50:>8.4f} {p90:>8.4f} {p99:>8.4f} "
            f"{(missing > 0.1).mean():>6.1%} {(missing > 0.5).mean():>6.1%}"
        )


if __name__ == "__main__":
    main()
