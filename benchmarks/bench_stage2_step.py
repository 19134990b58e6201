"""What does teacher-guided selection cost per training step? Target: a step with
--guidance token takes at most 1.05x the time of a step with --guidance none.

One optimizer step as stage 2 runs it (forward, per-token loss, selection, backward, AdamW) on a
from-scratch student with the tinyllama vocabulary, on packed batches from a real data path (--packing documents by default: with the document mask): the
shipped corpus with random teacher losses (selection cost does not depend on their values). The
modes are timed in turn, best of --repeats each, so they all see the same machine load; the
selection alone (guided_loss on the step's per-token losses) is timed too. Wall and CPU time are
both shown: CPU time is the steadier one on a machine that other work shares.

    python benchmarks/bench_stage2_step.py [--preset llama-small] [--seq-len 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the cache builder

from timing import interleaved_best_times, print_header, print_load_average  # noqa: E402

from pipeline.choices import PACKINGS  # noqa: E402
from pipeline.cross_entropy import token_loss  # noqa: E402
from pipeline.guidance import GuidanceSettings, guided_loss  # noqa: E402
from pipeline.models.student import build_student  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage2_train.attention import student_logits  # noqa: E402
from stage2_train.data.plan import DataPlan  # noqa: E402
from stage2_train.data.streams import consumer_stream  # noqa: E402
from tests.cache_fixtures import build_cache  # noqa: E402

MODES = ("none", "token", "random")


def training_step(model, optimizer, batch, settings: GuidanceSettings) -> float:
    logits = student_logits(model, batch, torch.device("cpu"))
    result = guided_loss(
        token_loss(logits, batch["labels"]),
        batch["teacher_loss"],
        batch["labels"] >= 0,
        settings,
        generator=torch.Generator().manual_seed(0),
    )
    (result.kept_loss_sum / result.kept.clamp(min=1)).backward()  # the mean over kept tokens
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(result.kept / result.valid)  # GuidedLoss counts are tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", default="llama-small", help="student preset (pipeline.models.student)"
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument(
        "--packing", default="documents", choices=PACKINGS, help="stage 2's --packing"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timings per mode (best kept)")
    args = parser.parse_args()

    tokenizer = load_tokenizer("tinyllama")
    with tempfile.TemporaryDirectory() as tmp:
        build_cache(Path(tmp), num_documents=64, docs_per_shard=64)
        plan = DataPlan.from_cache(
            Path(tmp),
            student_tokenizer="tinyllama",
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            packing=args.packing,
        )
        batch = next(iter(consumer_stream(plan, 0)))
    model = build_student(args.preset, tokenizer, seed=0, seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    settings = {mode: GuidanceSettings(mode=mode) for mode in MODES}
    kept = {
        mode: training_step(model, optimizer, batch, settings[mode]) for mode in MODES
    }  # warm-up

    with torch.no_grad():
        per_token = token_loss(student_logits(model, batch, torch.device("cpu")), batch["labels"])
    tasks = {
        f"step {mode}": (training_step, model, optimizer, batch, settings[mode]) for mode in MODES
    }
    for mode in MODES:
        tasks[f"select {mode}"] = (
            guided_loss,
            per_token,
            batch["teacher_loss"],
            batch["labels"] >= 0,
            settings[mode],
            torch.Generator().manual_seed(0),
        )
    wall, cpu = interleaved_best_times(args.repeats, tasks)

    params = sum(p.numel() for p in model.parameters())
    tokens = args.micro_batch_size * args.seq_len
    print(
        f"student {args.preset} ({params / 1e6:.1f}M parameters, "
        f"vocabulary {tokenizer.vocab_size}), "
        f"{args.micro_batch_size} x {args.seq_len} tokens per step ({args.packing} packing), {torch.get_num_threads()} "
        f"torch threads, best of {args.repeats}"
    )
    print()
    header = (
        f"{'guidance':<9} {'kept':>6} {'step ms':>9} {'CPU ms':>9} {'tokens/s':>9} "
        f"{'selection ms':>13} {'step / none':>12} {'CPU / none':>11}"
    )
    print_header(header)
    for mode in MODES:
        step, step_cpu = wall[f"step {mode}"], cpu[f"step {mode}"]
        print(
            f"{mode:<9} {kept[mode]:>6.2f} {1e3 * step:>9.1f} {1e3 * step_cpu:>9.1f} "
            f"{tokens / step:>9,.0f} {1e3 * wall[f'select {mode}']:>13.2f} "
            f"{step / wall['step none']:>11.3f}x {step_cpu / cpu['step none']:>10.3f}x"
        )
    print()
    # CPU time (all threads of this process) is the steadier figure on a machine others share.
    print("target: step token / step none <= 1.05 (wall and CPU time)")
    print_load_average()


if __name__ == "__main__":
    main()
