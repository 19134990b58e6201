"""How fast does one data-loader worker turn the cache into training batches? Target: the whole
data path (Parquet read + checks + student tokenization + alignment + aggregation + packing) at
least 0.8x the speed of bare student tokenization of the same texts, and far above the rate at
which the trainer consumes tokens.

A cache of the shipped GSM-style corpus (teacher tokenizer --teacher, random teacher losses: the
data path's cost does not depend on their values) is streamed by one consumer exactly as a
worker does (stage2_train.data.streams.consumer_stream, --packing documents by default), and
one epoch of it is timed in steady state (steady_epoch; the delivered tokens are its targets);
the bare tokenizer encodes the same texts, as new string objects each round like the data
path's, in the same read-sized batches with the same framing, by the call the data path makes
(TextTokenizer.encode_concatenated). Tokenizers run on one thread (one worker = one core). The
trainer's rate is one optimizer step of the --preset student on this machine.

With --topk K the cache also holds the teacher's top-K (the compact encoding) and the stream
distills from it (--distill uld: probabilities and rest; kld: ids too, with the teacher's
tokenizer as the student's): the data path is then also timed without the column checks stage 2
runs on every read of those columns (pipeline.cache.rows.check_extra_columns, `cache verify`'s),
to state what they cost.
Data path and tokenizer are timed in turn, best of --repeats, so they see the same machine load;
rates are shown by wall time and by CPU time (the steadier one on a machine others share), and
the ratio also as the median over the back-to-back pairs (robust to a lucky or unlucky round).

    python benchmarks/bench_stage2_data.py [--docs 2000] [--teacher qwen2.5] [--student tinyllama]
        [--topk 32 [--distill uld|kld]]
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers starts its thread pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the cache builder

from timing import (  # noqa: E402
    Elapsed,
    best_times,
    interleaved_best_times,
    measure,
    print_header,
    print_load_average,
)

from pipeline.choices import PACKINGS  # noqa: E402
from pipeline.cross_entropy import IGNORE_INDEX  # noqa: E402
from pipeline.distillation.kld import TopkKLDistillation  # noqa: E402
from pipeline.distillation.uld import UniversalLogitDistillation  # noqa: E402
from pipeline.models.student import build_student  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage2_train.data import documents as data_path  # noqa: E402
from stage2_train.data.documents import READ_ROWS  # noqa: E402
from stage2_train.data.plan import DataPlan  # noqa: E402
from stage2_train.data.streams import consumer_stream  # noqa: E402
from tests.cache_fixtures import build_cache, corpus_documents  # noqa: E402


def steady_epoch(plan: DataPlan) -> tuple[int, Elapsed]:
    """Student targets one consumer delivers in one epoch, and the time they took, in steady
    state: from the first micro-batch whose position reaches the epoch's second work item to the
    first that reaches the next epoch's. Both ends have read ahead alike, so neither the start-up
    nor the read a finite run leaves half used (tokenized, not yet delivered; a real run trains on
    it) is charged. Padding and re-read context are no targets: they count as cost, not as
    delivered tokens."""
    tokens, begin = 0, None
    for batch in consumer_stream(plan, 0):
        reached = (batch["position"]["epoch"], batch["position"]["item"])
        if begin is None:
            if reached >= (0, 1):
                begin = time.perf_counter(), time.process_time()
            continue
        tokens += int(np.count_nonzero(batch["labels"].numpy() != IGNORE_INDEX))  # no torch op
        if reached >= (1, 1):
            return tokens, Elapsed(time.perf_counter() - begin[0], time.process_time() - begin[1])
    raise AssertionError("unreachable: streams are endless")


def tokenize_reads(tokenizer, texts: list[str]) -> int:
    tokens = 0
    for first in range(0, len(texts), READ_ROWS):
        read = tokenizer.encode_concatenated(texts[first : first + READ_ROWS], add_eos=True)
        tokens += read.ids.size
    return tokens


def train_step(model, optimizer, inputs) -> None:
    model(input_ids=inputs, labels=inputs).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=2000, help="documents in the cache")
    parser.add_argument("--teacher", default="qwen2.5", help="teacher tokenizer of the cache")
    parser.add_argument("--student", default="tinyllama", help="student tokenizer")
    parser.add_argument("--preset", default="llama-small", help="student for the trainer's rate")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument(
        "--packing", default="documents", choices=PACKINGS, help="stage 2's --packing"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure (best kept)")
    parser.add_argument("--topk", type=int, default=0, help="the cache's top-K columns (0: none)")
    parser.add_argument("--distill", default="uld", choices=("uld", "kld"),
                        help="with --topk: the term the stream reads them for")  # fmt: skip
    args = parser.parse_args()
    if args.topk and args.distill == "kld":
        args.student = args.teacher  # KLD reads the teacher's ids as the student's
    terms = {"uld": UniversalLogitDistillation, "kld": TopkKLDistillation}
    distillation = terms[args.distill]() if args.topk else None

    documents = corpus_documents(args.docs)
    texts = [text for _, text in documents]
    student = load_tokenizer(args.student)
    total = tokenize_reads(student, texts)
    with tempfile.TemporaryDirectory() as tmp:
        build_cache(
            Path(tmp),
            teacher_tokenizer=args.teacher,
            documents=documents,
            docs_per_shard=max(1, args.docs // 4),
            topk=args.topk,
            topk_encoding="compact",
        )
        plan = DataPlan.from_cache(
            Path(tmp),
            student_tokenizer=args.student,
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            packing=args.packing,
            alignment="identity" if args.distill == "kld" and args.topk else "token",
            distillation=distillation,
        )
        times = {"data path": [], "tokenize": []}
        if args.topk:
            times["data path, no column checks"] = []
        streamed = 0
        for _ in range(args.repeats):  # in turn, so that all see the same machine load
            streamed, took = steady_epoch(plan)
            times["data path"].append(took)
            if args.topk:  # unchecked, each column is decoded where it is read (token_values)
                with mock.patch.object(data_path, "check_extra_columns", lambda *_: {}):
                    times["data path, no column checks"].append(steady_epoch(plan)[1])
            # New string objects, as the data path's are: Python keeps a string's UTF-8 form,
            # which the tokenizer reads, so strings tokenized before would skip that work.
            fresh = [text.encode().decode() for text in texts]
            with measure() as took:
                tokenize_reads(student, fresh)
            times["tokenize"].append(took)
        wall, cpu = best_times(times)
        # each round's two timings ran back to back: their ratio is steadier than the best-ofs
        pairs = [
            (streamed / data.cpu) / (total / bare.cpu)
            for data, bare in zip(times["data path"], times["tokenize"], strict=True)
        ]
    # The trainer last: a worker process runs no torch compute, and torch's OpenMP threads, once
    # started, keep spinning and would slow the single-threaded tokenizer timings.
    model = build_student(args.preset, student, seed=0, seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs = torch.randint(0, student.vocab_size, (args.micro_batch_size, args.seq_len))
    train_step(model, optimizer, inputs)  # warm-up
    train_wall, train_cpu = interleaved_best_times(
        args.repeats, {"train step": (train_step, model, optimizer, inputs)}
    )
    step_tokens = args.micro_batch_size * args.seq_len
    rates = {  # (wall, CPU) student tokens per second
        "bare student tokenization": (total / wall["tokenize"], total / cpu["tokenize"]),
        "data path (one worker)": (streamed / wall["data path"], streamed / cpu["data path"]),
    }
    unchecked = "data path, no column checks"
    if unchecked in times:
        rates["  without column checks"] = (streamed / wall[unchecked], streamed / cpu[unchecked])
    rates["trainer consumption (one rank)"] = (
        step_tokens / train_wall["train step"],
        step_tokens / train_cpu["train step"],
    )
    columns = f"top-{args.topk} columns read for {args.distill}; " if args.topk else ""
    print(
        f"{args.docs} documents, {total:,} {args.student} tokens (teacher {args.teacher}); "
        f"{columns}one "
        f"thread per tokenizer; {args.packing} packing; trainer: {args.preset}, {args.micro_batch_size} x {args.seq_len} "
        f"tokens per step, {torch.get_num_threads()} torch threads; best of {args.repeats}"
    )
    print()
    header = f"{'':<31} {'tokens/s':>10} {'relative':>9} {'tokens/CPU-s':>13} {'relative':>9}"
    print_header(header)
    base = rates["bare student tokenization"]
    for name, (by_wall, by_cpu) in rates.items():
        print(
            f"{name:<31} {by_wall:>10,.0f} {by_wall / base[0]:>8.3f}x "
            f"{by_cpu:>13,.0f} {by_cpu / base[1]:>8.3f}x"
        )
    data, train = rates["data path (one worker)"], rates["trainer consumption (one rank)"]
    print()
    print(
        f"data path / tokenization = {data[0] / base[0]:.2f} by wall time, "
        f"{data[1] / base[1]:.2f} by CPU time (target >= 0.8); median of the {args.repeats} "
        f"back-to-back pairs by CPU time {statistics.median(pairs):.2f} (range "
        f"{min(pairs):.2f}-{max(pairs):.2f}); one worker feeds "
        f"{data[0] / train[0]:,.0f}x what one rank's trainer consumes"
    )
    if args.topk:
        unchecked = rates["  without column checks"]
        print(
            f"the column checks cost: data path with / without them = {data[0] / unchecked[0]:.3f} "
            f"by wall time, {data[1] / unchecked[1]:.3f} by CPU time"
        )
    print_load_average()


if __name__ == "__main__":
    main()
