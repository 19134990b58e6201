"""A worker's first unit, tokenized alone or beside its second: what the teacher waits for at a
job's start. Under --unit-overlap a worker's first two units arrive together; the tokenizer
spreads one call over every core, so two calls at once share them. The worker tokenizes its
units in turn (stage1_score/worker.py), so its first unit reaches the teacher after its own
tokenizing alone; this prints what that is worth on this machine, side by side in one run.

    python benchmarks/bench_stage1_tokenizing.py [--tokenizer qwen2.5] [--docs 1000] [--repeats 7]

Each round, in turn: the first unit (--docs documents of the shipped training split) tokenized
alone, then beside the second unit (the next --docs documents, begun in another thread at the
same moment), as the worker tokenizes (`encode_batch`, then each encoding's ids). Printed: the
first unit's wall time each way (median and range over the rounds), the ratio of the two (the
median of the rounds' ratios, and their range), and both units' wall time in turn against at
once (what taking turns costs the second unit, which the teacher needs only a unit later).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time

from timing import print_header, print_load_average

from pipeline.corpus import Corpus, CorpusOptions
from pipeline.shipped import shipped_corpus
from pipeline.tokenizer import load_tokenizer


def tokenized(tokenizer, texts: list[str]) -> float:
    """The end, in perf_counter seconds, of tokenizing `texts` as a worker does."""
    _ = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    return time.perf_counter()


def one_round(tokenizer, first: list[str], second: list[str]) -> dict[str, float]:
    """Seconds of: the first unit alone, the first beside the second, both at once, both in turn."""
    start = time.perf_counter()
    alone = tokenized(tokenizer, first) - start
    in_turn = tokenized(tokenizer, second) - start  # the first, then the second
    ends = {}
    beside = threading.Thread(
        target=lambda: ends.setdefault("second", tokenized(tokenizer, second))
    )
    start = time.perf_counter()
    beside.start()
    ends["first"] = tokenized(tokenizer, first)
    beside.join()
    return {
        "first alone": alone,
        "first beside the second": ends["first"] - start,
        "both in turn": in_turn,
        "both at once": max(ends.values()) - start,
    }


def spread(values: list[float], scale: float = 1.0, unit: str = "") -> str:
    """The median and the range of `values`."""
    low, mid, high = (scale * v for v in (min(values), statistics.median(values), max(values)))
    return f"{mid:,.3g}{unit} [{low:,.3g}, {high:,.3g}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="qwen2.5", help="a shipped name, folder or hub id")
    parser.add_argument("--docs", type=int, default=1000, help="documents per unit")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    documents = Corpus(shipped_corpus("train"), CorpusOptions(id_column="id"))
    texts = [document.text for document in itertools.islice(documents, 2 * args.docs)]
    first, second = texts[: args.docs], texts[args.docs :]
    tokenized(tokenizer, texts)  # warm: the tokenizer's thread pool and caches
    rounds = [one_round(tokenizer, first, second) for _ in range(args.repeats)]
    print_header(
        f"{args.tokenizer}, units of {len(first):,} and {len(second):,} documents, "
        f"{args.repeats} rounds: median [range]"
    )
    for name in rounds[0]:
        print(f"{name:<26}{spread([r[name] for r in rounds], 1e3, ' ms')}")
    ratios = [r["first beside the second"] / r["first alone"] for r in rounds]
    print(f"the first unit beside / alone: {spread(ratios)} (what tokenizing in turn saves)")
    costs = [r["both in turn"] / r["both at once"] for r in rounds]
    print(f"both units in turn / at once:  {spread(costs)}")
    print_load_average()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
