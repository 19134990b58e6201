"""The demo's report: what ran, what it measured, as Markdown with PNG figures beside it.

Numbers are reported as measured; nothing here judges whether guidance "won".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from apps.analysis.configs import TrainingCurvesConfig
from apps.analysis.plotting import new_figure, save_png
from apps.analysis.training_curves import plot_training_curves, read_metrics
from apps.demo.config import DemoConfig
from pipeline.cache.manifest import load_manifest
from pipeline.io import atomic_write_text
from pipeline.tokenizer import load_tokenizer
from pipeline.vocab_overlap import vocabulary_overlap

TAIL_STEPS = 5  # training loss is reported as the mean of the last steps: single steps are noisy


def _plot_bits_per_character(results: dict, dest: Path) -> None:
    names = list(results)
    values = [results[n]["bits_per_character"]["bits_per_character"] for n in names]
    fig, (ax,) = new_figure(width_per_panel=6.5)
    bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_ylabel("held-out bits per character (lower is better)")
    ax.set_title("Held-out loss, comparable across tokenizers", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    save_png(fig, dest, "vocagno demo: held-out bits per character")


def _arm_row(arm: str, out: Path, seconds: float | None) -> str:
    metrics = read_metrics(out).columns
    tail = slice(-TAIL_STEPS, None)
    return (
        f"| `--guidance {arm}` | {int(metrics['step'][-1])} | {int(metrics['tokens'][-1]):,} | "
        f"{np.nanmean(metrics['loss_all'][tail]):.3f} | {np.nanmean(metrics['loss'][tail]):.3f} | "
        f"{np.nanmean(metrics['kept_fraction']):.3f} | {np.nanmean(metrics['mapped_fraction']):.3f} | "
        f"{seconds if seconds is not None else '-'} |"
    )


def write_report(
    config: DemoConfig,
    teacher: Path,
    cache: Path,
    arms: dict[str, Path],
    results: dict,
    timings: dict,
) -> Path:
    manifest = load_manifest(cache)
    student_tokenizer = load_tokenizer(config.student_tokenizer)
    teacher_tokenizer = load_tokenizer(str(teacher))
    overlap = vocabulary_overlap(student_tokenizer, teacher_tokenizer)
    plot_training_curves(
        TrainingCurvesConfig(run_dirs=list(arms.values()), out=config.out / "training_curves.png")
    )
    _plot_bits_per_character(results, config.out / "bits_per_character.png")

    lines = [
        "# vocagno demo report",
        "",
        "Everything below was measured by this run; nothing is copied from the paper.",
        "",
        "## Setup",
        f"- Teacher: SmolLM2-135M-Instruct (fp32), tokenizer vocabulary {overlap.teacher_vocab:,}.",
        f"- Student: `{config.student}` with the `{config.student_tokenizer}` tokenizer "
        f"(vocabulary {overlap.student_vocab:,}); shared token strings: {overlap.shared:,} "
        f"= {100 * overlap.shared_over_teacher:.2f}% of the teacher's vocabulary.",
        f"- Cache: {manifest.total_rows:,} documents, {manifest.total_teacher_tokens:,} teacher "
        f"tokens in {len(manifest.shards)} shards, {len(manifest.skipped)} skipped; producer "
        f"`{manifest.producer_fingerprint}`.",
        "",
        "## Training (same data, same steps, same initial weights)",
        "",
        "| arm | steps | tokens | loss_all (last steps) | loss over kept (last steps) | kept | mapped | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(_arm_row(arm, out, timings.get(f"stage2-{arm}")) for arm, out in arms.items()),
        "",
        "![training curves](training_curves.png)",
        "",
        *(
            [
                "[inspect.html](inspect.html): one training document as the guided student sees it "
                "(excess loss per token, kept or dropped, the teacher tokens each maps to).",
                "",
            ]
            if (config.out / "inspect.html").exists()
            else []
        ),
        "## Evaluation (held-out split of the corpus)",
        "",
        "| model | bits per character | answer accuracy |",
        "|---|---:|---:|",
    ]
    for name, result in results.items():
        bpc = result["bits_per_character"]["bits_per_character"]
        accuracy = result.get("answer_accuracy")
        acc = f"{accuracy['correct']}/{accuracy['problems']}" if accuracy else "-"
        lines.append(f"| {name} | {bpc:.4f} | {acc} |")
    lines += [
        "",
        "![bits per character](bits_per_character.png)",
        "",
        "## Wall time (seconds)",
        "",
        "```json",
        json.dumps(timings, indent=2),
        "```",
        "",
    ]
    dest = config.out / "report.md"
    atomic_write_text(dest, "\n".join(lines))
    return dest
