"""What does the cache save? Time per student step with the teacher running in the loop (what the
method costs without a cache) against reading the teacher's losses from the cache, and how many
student runs it takes for scoring once (stage 1) to pay off.

Teacher: the real SmolLM2-135M-Instruct (pipeline.models.teacher_assets, fp32, transformers on the CPU).
Student: a from-scratch --preset with the tinyllama vocabulary; llama-small (19.5M parameters)
against the 135M teacher is about the paper's ratio (TinyLlama 1.1B against 7B teachers).
1. Stage 1 (stage1_score/run.py, a subprocess: Ray, teacher load, scoring, shards, manifest)
   scores --docs documents of the shipped corpus once: the cost of the cache.
2. One epoch over those documents is trained twice, the same steps of the same student, the
   two runs taking turns step by step:
   - online: the same stream (stage2_train.data.packing.ConsumerStream), but each read's texts are
     tokenized and scored by the loaded teacher (pipeline.scoring.hf.HFScorer) before
     alignment; the cached losses are not used;
   - cached: the stream as stage 2 runs it, losses from the cache.
   With --guidance uld (docs/distillation.md) stage 1 also stores the teacher's top-K
   (--topk-probs K --no-topk-ids: ULD reads no ids), the online side computes the same top-K per
   read from the same logits chunks (HFScorer with pipeline.scoring.head.HeadExtras), both sides
   pair it with the student tokens as stage 2 does (annotate with the ULD term) and each step adds
   the ULD term to the cross-entropy (bench_stage2_distillation.training_step).
   Per-step time = the epoch's wall time / its steps (the teacher's work is amortized over them).
Runs to pay off = scoring's time / (per-step saving x steps per run), for runs of one epoch;
scoring's time is shown both as stage 1 end to end (start-up included: dominant on a small
corpus) and as the teacher's own work (what remains on a large one). The teacher's load time is
left out of the online side, which favours it.

    python benchmarks/bench_stage2_cache_vs_online.py [--docs 16] [--seq-len 256] \
        [--guidance token|uld] [--topk-probs 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/ holds the corpus reader for fixtures

from bench_stage2_distillation import training_step as distillation_step  # noqa: E402
from bench_stage2_step import training_step  # noqa: E402
from timing import Elapsed, measure, print_header, print_load_average  # noqa: E402

from pipeline.cache.manifest import load_manifest  # noqa: E402
from pipeline.cache.schema import LOSS  # noqa: E402
from pipeline.distillation.topk import PROBS  # noqa: E402
from pipeline.distillation.uld import UniversalLogitDistillation  # noqa: E402
from pipeline.guidance import GuidanceSettings  # noqa: E402
from pipeline.log import configure  # noqa: E402
from pipeline.models.student import build_student  # noqa: E402
from pipeline.models.teacher_assets import prepare_smollm2_teacher  # noqa: E402
from pipeline.scoring.head import HeadExtras  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage2_train.data.documents import annotate  # noqa: E402
from stage2_train.data.packing import ConsumerStream  # noqa: E402
from stage2_train.data.plan import DataPlan  # noqa: E402
from tests.cache_fixtures import corpus_documents  # noqa: E402


class OnlineTeacherStream(ConsumerStream):
    """ConsumerStream whose teacher losses (and, under a distillation, the columns it reads)
    come from a live teacher instead of the cache."""

    def __init__(self, plan: DataPlan, scorer, teacher_tokenizer):
        super().__init__(plan, 0)
        self.scorer, self.teacher_tokenizer = scorer, teacher_tokenizer
        self.teacher = Elapsed()  # tokenizing and scoring, summed over reads

    def _annotate_rows(self, rows, more=()):
        texts = rows.texts
        with measure(self.teacher):
            encodings = self.teacher_tokenizer.encode_batch(texts)
            columns = self.scorer.score_columns([e.ids for e in encodings])
        flat = {name: np.concatenate(values) for name, values in columns.items()}
        docs = annotate(
            self.tokenizer,
            texts,
            np.concatenate([e.start for e in encodings]).astype(np.int64),
            np.concatenate([e.end for e in encodings]).astype(np.int64),
            flat.pop(LOSS),
            np.array([len(e) for e in encodings]),
            alignment=self.plan.alignment,
            aggregate=self.plan.aggregate,
            distillation=self.plan.distillation,
            teacher_columns=flat,
        )
        docs.doc_ids = rows.doc_ids
        return docs


def train_side_by_side(streams: dict, steps: int, args, tokenizer, term) -> dict:
    """Per stream: the Elapsed time of `steps` student steps (data + step), run in turn step
    by step so that both see the same machine load, and the teacher values of its batches (the
    paired top-k probabilities under ULD, else the losses)."""
    settings = GuidanceSettings()
    seen_key = "teacher_loss" if term is None else PROBS
    sides = {}
    for name, stream in streams.items():
        model = build_student(args.preset, tokenizer, seed=0, seq_len=args.seq_len)
        sides[name] = (iter(stream), model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    seconds = {name: Elapsed() for name in streams}
    seen = {name: [] for name in streams}
    for _ in range(steps):
        for name, (batches, model, optimizer) in sides.items():
            with measure(seconds[name]):
                batch = next(batches)
                if term is None:
                    training_step(model, optimizer, batch, settings)
                else:
                    distillation_step(model, optimizer, batch, args.guidance, term)
            seen[name].append(batch[seen_key].float())
    return {name: (seconds[name], seen[name]) for name in streams}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=16, help="documents scored and trained on")
    parser.add_argument("--preset", default="llama-small", help="student preset")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument(
        "--guidance",
        default="token",
        choices=("token", "uld"),
        help="token: VocAgnoLM's guided loss from teacher losses; uld: cross-entropy plus the ULD "
        "term from the teacher's top-k (cached by stage 1 --topk-probs, or computed online)",
    )
    parser.add_argument(
        "--topk-probs", type=int, default=32, help="K of the teacher's top-k (with --guidance uld)"
    )
    args = parser.parse_args()
    configure()  # the teacher's preparation reports its steps

    term = UniversalLogitDistillation() if args.guidance == "uld" else None
    topk = ["--topk-probs", str(args.topk_probs), "--no-topk-ids"] if term else []
    teacher = prepare_smollm2_teacher()
    student_tokenizer = load_tokenizer("tinyllama")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        corpus.write_text(
            "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in corpus_documents(args.docs))
        )
        # 1. Score once: the whole of stage 1, as a user runs it.
        with measure() as stage1:
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "stage1_score" / "run.py"),
                    "--teacher",
                    str(teacher),
                    "--corpus",
                    str(corpus),
                    "--out",
                    str(tmp / "cache"),
                    "--id-column",
                    "id",
                    "--docs-per-shard",
                    str(args.docs),
                    "--max-length",
                    "2048",
                    *topk,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        manifest = load_manifest(tmp / "cache")
        plan = DataPlan.from_cache(
            tmp / "cache",
            student_tokenizer="tinyllama",
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            distillation=term,
        )
        student_tokens = sum(
            len(e)
            for e in student_tokenizer.encode_batch(
                [t for _, t in corpus_documents(args.docs)], add_eos=True
            )
        )
        steps = (student_tokens - 1) // (args.seq_len * args.micro_batch_size)  # one epoch

        # 2. The same epoch twice: teacher in the loop, then from the cache.
        from pipeline.scoring.hf import HFScorer
        from pipeline.scoring.resolve import Asked
        from pipeline.scoring.teacher import resolve_teacher

        with measure() as teacher_load:
            scorer = HFScorer(
                resolve_teacher(str(teacher)),
                max_length=2048,
                stride=1024,
                batch_tokens=16384,
                asked=Asked("float32"),
                extras=HeadExtras(topk=args.topk_probs if term else 0, topk_ids=False),
            ).load()
        online_stream = OnlineTeacherStream(plan, scorer, load_tokenizer(str(teacher)))
        results = train_side_by_side(
            {"online": online_stream, "cached": ConsumerStream(plan, 0)},
            steps,
            args,
            student_tokenizer,
            term,
        )

    (online, online_cpu), (cached, cached_cpu) = (
        (results[name][0].wall / steps, results[name][0].cpu / steps)
        for name in ("online", "cached")
    )
    pairs = list(zip(results["online"][1], results["cached"][1], strict=True))
    difference = max(float((a - b).abs().nan_to_num().max()) for a, b in pairs)
    # a difference of 0 says nothing unless values were compared and NaN (none) agrees
    compared_values = sum(int((~a.isnan() & ~b.isnan()).sum()) for a, b in pairs)
    same_nan = all(torch.equal(a.isnan(), b.isnan()) for a, b in pairs)
    saving_per_run = (online - cached) * steps
    # what the cache holds and the comparison checks: losses, or under ULD the paired top-k
    cached_what, compared = "teacher losses", "teacher loss"
    if term is not None:
        cached_what, compared = "teacher top-k", f"paired teacher top-{args.topk_probs} probability"
    print(
        f"{args.docs} documents, {student_tokens:,} student tokens, "
        f"{manifest.total_teacher_tokens:,} "
        f"teacher tokens; student {args.preset}, {steps} steps of {args.micro_batch_size} x "
        f"{args.seq_len} tokens = one epoch; teacher SmolLM2-135M fp32 (load {teacher_load.wall:.1f} s)"
    )
    if term is not None:
        print(
            f"guidance uld: cross-entropy + {term.weight} x ULD over the teacher's top-"
            f"{args.topk_probs} (stage 1 --topk-probs {args.topk_probs} --no-topk-ids)"
        )
    print()
    header = f"{'':<28} {'s / step':>9} {'relative':>9} {'CPU s / step':>13} {'relative':>9}"
    print_header(header)
    print(
        f"{'teacher in the loop':<28} {online:>9.2f} {online / cached:>8.2f}x "
        f"{online_cpu:>13.2f} {online_cpu / cached_cpu:>8.2f}x"
    )
    print(
        f"{cached_what + ' from cache':<28} {cached:>9.2f} {1:>8.2f}x {cached_cpu:>13.2f} {1:>8.2f}x"
    )
    print()
    print(f"saving per one-epoch run: {saving_per_run:.1f} s")
    print(
        f"scoring once, stage 1 end to end (with Ray and teacher start-up): {stage1.wall:.1f} s"
        f" -> pays off after {stage1.wall / saving_per_run:.2f} runs"
    )
    marginal = online_stream.teacher.wall
    print(
        f"scoring once, teacher work only (a corpus large enough to amortize start-up): "
        f"{marginal:.1f} s -> pays off after {marginal / saving_per_run:.2f} runs"
    )
    print(
        f"online vs cached {compared} per student token: max |difference| {difference:.4f} "
        f"over {compared_values:,} values, NaN at the same places: {same_nan} "
        "(cache stores float16)"
    )
    print_load_average()


if __name__ == "__main__":
    main()
