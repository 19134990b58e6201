"""What do the distillation objectives cost per training step? `--guidance uld`, `kld`, their
sampled estimates `uld-sampled` and `kld-sampled` (docs/distillation.md) and `alm` (docs/alm.md)
against `none` and `token`, timed side by side. Targets: alm / token <= 1.10 (issue 19); the
others are reported.

One optimizer step as stage 2 runs it (forward, per-token loss, selection or distillation term,
backward, AdamW) on a from-scratch student with the tinyllama vocabulary, on one packed batch from
the real data path: the shipped corpus with a seeded top-K cache scored "by" the student's own
tokenizer (so KLD's identity alignment applies; the cost does not depend on the values), seeded
space log-probabilities for ALM and, for the sampled modes, a seeded sampled cache of K draws. Every term reads the student's distribution through the
cross-entropy's own pass over the vocabulary (pipeline.head_outputs, `--loss-kernel plain`): log
Z from the cross-entropy, plus a topk of K (uld), a gather (kld, kld-sampled), a sort of the
whole vocabulary (uld-sampled) or, for alm, the space mask's mass and the chunk sums. Modes run in turn, best of --repeats each; wall and CPU time are both shown
(CPU time is steadier on a shared machine).

    python benchmarks/bench_stage2_distillation.py [--preset llama-small] [--topk-probs 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the cache builder

from timing import interleaved_best_times, print_header, print_load_average  # noqa: E402

from pipeline.distillation import vocabulary_subset_on  # noqa: E402
from pipeline.distillation.alm import AlmDistillation  # noqa: E402
from pipeline.distillation.kld import TopkKLDistillation  # noqa: E402
from pipeline.distillation.sampled import (  # noqa: E402
    SampledKLDistillation,
    SampledULDistillation,
)
from pipeline.distillation.uld import UniversalLogitDistillation  # noqa: E402
from pipeline.guidance import GuidanceSettings, guided_loss  # noqa: E402
from pipeline.head_outputs import HeadReads, head_outputs  # noqa: E402
from pipeline.models.student import build_student  # noqa: E402
from pipeline.space_mask import space_mask  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage2_train.attention import student_logits  # noqa: E402
from stage2_train.data.plan import DataPlan  # noqa: E402
from stage2_train.data.streams import consumer_stream  # noqa: E402
from tests.cache_fixtures import build_cache  # noqa: E402


def distillations(tokenizer) -> dict:
    """Each objective with its defaults (ALM: tokenkit's, with the student's space mask)."""
    return {
        "uld": UniversalLogitDistillation(),
        "kld": TopkKLDistillation(),
        "kld-sampled": SampledKLDistillation(),
        "uld-sampled": SampledULDistillation(teacher_vocab=tokenizer.vocab_size),
        "alm": AlmDistillation(
            weight=1.0,
            temperature=100.0,
            merge_threshold=0.1,
            mode="merge_by_space_prob+append_space",
            space_mask=space_mask(tokenizer)[0],
        ),
    }


def training_step(model, optimizer, batch, mode: str, term) -> None:
    """The trainer's objective for one micro-batch: eq. 3's loss, plus weight x the term's mean."""
    logits = student_logits(model, batch, torch.device("cpu"))
    guided = "none" if term is not None else mode  # a distillation trains every token
    reads, extras = HeadReads(), None
    if term is not None:
        extras = {name: batch[name] for name in term.extra_names}
        # the trainer makes the subset once per run
        reads = term.reads(extras, vocabulary_subset_on(term, torch.device("cpu")))
    student = head_outputs(logits, batch["labels"], reads)
    result = guided_loss(
        student.loss,
        batch["teacher_loss"],
        batch["labels"] >= 0,
        GuidanceSettings(mode=guided),
        generator=torch.Generator().manual_seed(0),
    )
    objective = result.kept_loss_sum / result.valid.clamp(min=1)  # eq. 3
    if term is not None:
        units = term.units(batch["labels"], extras).clamp(min=1)
        total = term.loss_sum(student, batch["labels"], extras)
        objective = objective + term.weight * total / units
    objective.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", default="llama-small", help="student preset (pipeline.models.student)"
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--topk-probs", type=int, default=32, help="K of the cached top-k")
    parser.add_argument("--repeats", type=int, default=7, help="timings per mode (best kept)")
    args = parser.parse_args()

    tokenizer = load_tokenizer("tinyllama")
    terms = distillations(tokenizer)
    modes = ("none", "token", *terms)
    # the batch each objective reads (its extras): uld's is kld's, uld-sampled's kld-sampled's
    batch_source = {"uld": "kld", "uld-sampled": "kld-sampled", "none": "kld", "token": "kld"}
    with tempfile.TemporaryDirectory() as tmp:
        caches = {"top": Path(tmp) / "top", "sampled": Path(tmp) / "sampled"}
        for mode, cache in caches.items():
            build_cache(
                cache,
                teacher_tokenizer="tinyllama",
                num_documents=64,
                docs_per_shard=64,
                topk=args.topk_probs,
                topk_mode=mode,
                space_logprob=mode == "top",
            )
        batches = {}  # one packed batch, with the extras each objective reads
        for name in ("kld", "alm", "kld-sampled"):
            plan = DataPlan.from_cache(
                caches["sampled" if name == "kld-sampled" else "top"],
                student_tokenizer="tinyllama",
                alignment="identity",
                seq_len=args.seq_len,
                micro_batch_size=args.micro_batch_size,
                distillation=terms[name],
            )
            batches[name] = next(iter(consumer_stream(plan, 0)))
    batch_of = {mode: batches[batch_source.get(mode, mode)] for mode in modes}
    model = build_student(args.preset, tokenizer, seed=0, seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tasks = {
        mode: (training_step, model, optimizer, batch_of[mode], mode, terms.get(mode))
        for mode in modes
    }
    for task in tasks.values():  # warm-up
        task[0](*task[1:])
    wall, cpu = interleaved_best_times(args.repeats, tasks)

    params = sum(p.numel() for p in model.parameters())
    tokens = args.micro_batch_size * args.seq_len
    print(
        f"student {args.preset} ({params / 1e6:.1f}M parameters, vocabulary "
        f"{tokenizer.vocab_size}), {args.micro_batch_size} x {args.seq_len} tokens per step, "
        f"cached top-{args.topk_probs} or {args.topk_probs} draws, {torch.get_num_threads()} torch threads, best of "
        f"{args.repeats}"
    )
    print()
    header = (
        f"{'guidance':<11} {'step ms':>9} {'CPU ms':>9} {'tokens/s':>9} {'step / none':>12} "
        f"{'CPU / none':>11} {'step / token':>13} {'CPU / token':>12}"
    )
    print_header(header)
    for mode in modes:
        print(
            f"{mode:<11} {1e3 * wall[mode]:>9.1f} {1e3 * cpu[mode]:>9.1f} "
            f"{tokens / wall[mode]:>9,.0f} {wall[mode] / wall['none']:>11.3f}x "
            f"{cpu[mode] / cpu['none']:>10.3f}x {wall[mode] / wall['token']:>12.3f}x "
            f"{cpu[mode] / cpu['token']:>11.3f}x"
        )
    print()
    print("target: alm / token <= 1.10 (step and CPU time)")
    print_load_average()


if __name__ == "__main__":
    main()
