"""How much does packing bias the excess loss? Stage 1 scores every document with its full context;
stage 2 with `--packing stream` cuts documents at window boundaries without an attention mask,
so the first tokens of a window that continues a cut document are predicted with little context
but compared with a teacher loss computed with plenty: their excess (student - teacher loss) is
inflated and top-k selection over-picks them. `--packing documents` packs whole documents with a
document mask and gives a split document's continuation its preceding context without loss.

For each packing, one consumer's first --batches micro-batches of a real cache (stage 1 output)
go through --student; the report compares the mean excess of the first --first new targets of
continued documents ("starved") with that of every other mapped target, and gives the packing
efficiency (slots holding a real token / all slots; targets / slots). With the teacher itself
as the student (same model, same tokenizer: identity alignment), the excess isolates the effect
of context: it is ~0 wherever the student sees what the teacher saw.

    python benchmarks/bench_packing_bias.py --cache DIR --student TEACHER_FOLDER \
        [--seq-len 256] [--micro-batch-size 4] [--batches 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cache.manifest import load_manifest  # noqa: E402
from pipeline.cross_entropy import IGNORE_INDEX, token_loss  # noqa: E402
from pipeline.models.student import build_student, student_tokenizer_spec  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage2_train.attention import student_logits  # noqa: E402
from stage2_train.data.document_packing import split_context  # noqa: E402
from stage2_train.data.documents import choose_alignment  # noqa: E402
from stage2_train.data.plan import DataPlan  # noqa: E402
from stage2_train.data.streams import consumer_stream  # noqa: E402


def starved_stream(batch: dict, eos_id: int, first: int, fresh_stream: bool) -> np.ndarray:
    """Stream packing: targets in a window's first `first` columns that still belong to the
    document the window began inside (no EOS among the inputs up to them)."""
    inputs = batch["input_ids"].numpy()
    continued = np.cumsum(inputs == eos_id, axis=1) == 0
    if fresh_stream:  # a stream's first window begins at a document's start
        continued[0] = False
    return continued & (np.arange(inputs.shape[1])[None, :] < first)


def continued_stream(batch: dict, eos_id: int, fresh_stream: bool) -> np.ndarray:
    continued = np.cumsum(batch["input_ids"].numpy() == eos_id, axis=1) == 0
    if fresh_stream:
        continued[0] = False
    return continued


def continuation_pieces(batch: dict) -> np.ndarray:
    """Documents packing: slots of pieces that continue a split document (their first slot is
    context: no label)."""
    segments, labels = batch["segment_ids"].numpy(), batch["labels"].numpy()
    positions = batch["position_ids"].numpy()
    heads = (segments > 0) & (positions == 0) & (labels == IGNORE_INDEX)
    return np.isin(segments, segments[heads]) & (segments > 0)


def measure(plan: DataPlan, model, batches: int, first: int, eos_id: int) -> dict:
    excess, starved, continued, valid = [], [], [], []
    real = slots = 0
    stream = iter(consumer_stream(plan, 0))
    context = split_context(plan)
    for index in range(batches):
        batch = next(stream)
        with torch.no_grad():
            logits = student_logits(model, batch, torch.device("cpu"))
            loss = token_loss(logits.float(), batch["labels"]).numpy()
        labels = batch["labels"].numpy()
        is_valid = labels != IGNORE_INDEX
        if plan.packing == "stream":
            is_starved = starved_stream(batch, eos_id, first, index == 0)
            is_continued = continued_stream(batch, eos_id, index == 0)
            real += labels.size
        else:
            pieces = continuation_pieces(batch)
            positions = batch["position_ids"].numpy()
            is_continued = pieces & is_valid
            is_starved = is_continued & (positions < context + first)
            real += int((batch["segment_ids"] > 0).sum())
        slots += labels.size
        excess.append(loss - batch["teacher_loss"].numpy())
        starved.append(is_starved & is_valid)
        continued.append(is_continued & is_valid)
        valid.append(is_valid)
    excess, starved = np.concatenate(excess), np.concatenate(starved)
    continued, valid = np.concatenate(continued), np.concatenate(valid)
    mapped = valid & ~np.isnan(excess)
    low, rest = excess[mapped & starved], excess[mapped & ~starved]
    return {
        "starved": float(low.mean()) if low.size else float("nan"),
        "rest": float(rest.mean()),
        "bias": float(low.mean() - rest.mean()) if low.size else float("nan"),
        "starved_tokens": int(low.size),
        "continued_fraction": float(continued.sum() / valid.sum()),
        "targets": int(valid.sum()),
        "real_per_slot": real / slots,
        "targets_per_slot": float(valid.sum() / slots),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="a stage 1 cache folder")
    parser.add_argument("--student", required=True, help="student model (e.g. the teacher folder)")
    parser.add_argument("--student-tokenizer", default=None)
    parser.add_argument("--seq-len", type=int, default=256, help="the demo's seq_len")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=8, help="micro-batches per packing")
    parser.add_argument("--first", type=int, default=64, help="context-starved targets")
    parser.add_argument("--packing-context", type=float, default=0.5)
    args = parser.parse_args()

    manifest = load_manifest(args.cache)
    tokenizer = load_tokenizer(student_tokenizer_spec(args.student, args.student_tokenizer))
    model = build_student(args.student, tokenizer, 0, args.seq_len).eval()
    results = {}
    for packing in ("stream", "documents"):
        plan = DataPlan.from_cache(
            args.cache,
            student_tokenizer=tokenizer.spec,
            alignment=choose_alignment("token", tokenizer.fingerprint, manifest.tokenizer),
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            packing=packing,
            packing_context=args.packing_context,
        )
        started = time.monotonic()
        results[packing] = measure(plan, model, args.batches, args.first, tokenizer.eos_id)
        results[packing]["seconds"] = time.monotonic() - started

    print(
        f"cache {args.cache} ({sum(s.rows for s in manifest.shards)} documents, teacher "
        f"{manifest.teacher.get('name', manifest.teacher)}), student {args.student}, "
        f"{args.batches} micro-batches of {args.micro_batch_size} x {args.seq_len} per packing, "
        f"starved = first {args.first} new targets of a continued document"
    )
    print()
    rows = [
        ("mean excess, starved targets", "starved", "{:+.4f}"),
        ("mean excess, all other targets", "rest", "{:+.4f}"),
        ("bias (starved - rest)", "bias", "{:+.4f}"),
        ("starved targets (mapped)", "starved_tokens", "{:d}"),
        ("targets in continued documents", "continued_fraction", "{:.1%}"),
        ("targets", "targets", "{:d}"),
        ("efficiency: real tokens / slots", "real_per_slot", "{:.3f}"),
        ("efficiency: targets / slots", "targets_per_slot", "{:.3f}"),
        ("seconds", "seconds", "{:.1f}"),
    ]
    print(f"{'':<34} {'stream (before)':>16} {'documents (after)':>18}")
    for label, key, form in rows:
        cells = [form.format(results[p][key]) for p in ("stream", "documents")]
        print(f"{label:<34} {cells[0]:>16} {cells[1]:>18}")


if __name__ == "__main__":
    main()
