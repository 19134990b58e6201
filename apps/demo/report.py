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
from apps.demo.comparison import METRICS, compare, value, verdict
from apps.demo.config import DemoConfig, PreRegistration
from pipeline.cache.manifest import load_manifest
from pipeline.io import atomic_write_text
from pipeline.tokenizer import load_tokenizer
from pipeline.vocab_overlap import vocabulary_overlap

TAIL_STEPS = 5  # training loss is reported as the mean of the last steps: single steps are noisy


def _plot_primary(results: dict, metric: str, dest: Path) -> None:
    names = list(results)
    values = [value(results[n], metric) for n in names]
    fig, (ax,) = new_figure(width_per_panel=6.5)
    bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
    ax.bar_label(bars, fmt="%.4f", fontsize=8)
    better = "lower" if METRICS[metric].lower_is_better else "higher"
    ax.set_ylabel(f"{METRICS[metric].label} ({better} is better)", fontsize=8)
    ax.set_ylim(min(values) * 0.98 if better == "lower" else 0, max(values) * 1.01)
    ax.set_title("Pre-registered primary metric, held-out problems", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    save_png(fig, dest, "vocagno demo: primary metric")


def _arm_row(arm: str, out: Path, seconds: float | None) -> str:
    metrics = read_metrics(out).columns
    tail = slice(-TAIL_STEPS, None)
    return (
        f"| `--guidance {arm}` | {int(metrics['step'][-1])} | {int(metrics['tokens'][-1]):,} | "
        f"{np.nanmean(metrics['loss_all'][tail]):.3f} | {np.nanmean(metrics['loss'][tail]):.3f} | "
        f"{np.nanmean(metrics['kept_fraction']):.3f} | {np.nanmean(metrics['mapped_fraction']):.3f} | "
        f"{seconds if seconds is not None else '-'} |"
    )


def _fmt(metric: str, result: dict) -> str:
    if metric not in result:
        return "-"
    text = METRICS[metric].fmt.format(value(result, metric))
    if metric == "answer_accuracy":
        text += f" ({result[metric]['correct']}/{result[metric]['problems']})"
    return text


def comparison_lines(results: dict, arms: list[str], prereg: PreRegistration) -> list[str]:
    """The pre-registered table: every model's metrics, every difference with its interval,
    and the plain statement of the outcome on the primary metric."""
    metrics = [prereg.primary, *prereg.secondary]
    rows = compare(results, prereg)
    pct = round(100 * prereg.confidence)
    lines = [
        "| model | " + " | ".join(
            f"{METRICS[m].label}{' (primary)' if m == prereg.primary else ''}" for m in metrics
        ) + " |",
        "|---|" + "---:|" * len(metrics),
        *(f"| {name} | " + " | ".join(_fmt(m, r) for m in metrics) + " |"
          for name, r in results.items()),
        "",
        f"Paired bootstrap over the same items ({prereg.resamples:,} resamples, seed "
        f"{prereg.seed}); difference = first arm − second arm.",
        "",
        f"| metric | comparison | difference | {pct}% interval | excludes 0 | better point value |",
        "|---|---|---:|---:|---|---|",
    ]  # fmt: skip
    for row in rows:
        d = row.difference
        lines.append(
            f"| {'**' + row.metric + '**' if row.metric == prereg.primary else row.metric} | "
            f"{row.a} − {row.b} | {d.difference:+.4f} | [{d.low:+.4f}, {d.high:+.4f}] | "
            f"{'yes' if d.excludes_zero else 'no'} | {row.better} |"
        )
    return [*lines, "", *verdict(results, arms, rows, prereg.primary)]


def write_report(
    config: DemoConfig,
    manifest_path: Path,
    teacher: Path,
    cache: Path,
    arms: dict[str, Path],
    results: dict,
    timings: dict,
    prereg: PreRegistration,
) -> Path:
    manifest = load_manifest(cache)
    student_tokenizer = load_tokenizer(config.student_tokenizer)
    teacher_tokenizer = load_tokenizer(str(teacher))
    overlap = vocabulary_overlap(student_tokenizer, teacher_tokenizer)
    plot_training_curves(
        TrainingCurvesConfig(run_dirs=list(arms.values()), out=config.out / "training_curves.png")
    )
    _plot_primary(results, prereg.primary, config.out / "primary_metric.png")
    warm = json.loads((config.out / "warm-start" / "warm_start.json").read_text())
    problems = results[next(iter(arms))].get("answer_bits", {}).get("problems", 0)

    lines = [
        "# vocagno demo report",
        "",
        "Everything below was measured by this run; nothing is copied from the paper.",
        "",
        "## Setup",
        f"- Teacher: SmolLM2-135M-Instruct (fp32), tokenizer vocabulary {overlap.teacher_vocab:,}.",
        f"- Student: `{config.student}` ({_parameters(arms)}) with the "
        f"`{config.student_tokenizer}` tokenizer "
        f"(vocabulary {overlap.student_vocab:,}); shared token strings: {overlap.shared:,} "
        f"= {100 * overlap.shared_over_teacher:.2f}% of the teacher's vocabulary.",
        f"- Cache: {manifest.total_rows:,} documents, {manifest.total_teacher_tokens:,} teacher "
        f"tokens in {len(manifest.shards)} shards, {len(manifest.skipped)} skipped; producer "
        f"`{manifest.producer_fingerprint}`.",
        f"- Warm start (shared by every arm): `{config.student}` trained plainly (no teacher) "
        f"for {warm['steps']} steps, {warm['tokens_trained']:,} tokens, on {warm['documents']} "
        "documents of the train split disjoint from the continual-pretraining slice; final "
        f"loss {np.mean([h['loss'] for h in warm['history'][-TAIL_STEPS:]]):.3f} nats/token.",
        f"- Continual pretraining: {config.train_docs} documents scored by the teacher; every "
        "arm starts from the warm start's weights with the same data order and token budget.",
        "",
        "## Pre-registered comparison",
        "",
        f"Fixed in `{manifest_path.name}` (`[preregistered]`, `[eval]`) before any run: primary "
        f"metric {METRICS[prereg.primary].label} on {problems} held-out problems; secondary "
        + ", ".join(METRICS[m].label for m in prereg.secondary)
        + "; comparisons "
        + ", ".join(f"`{p}`" for p in prereg.comparisons)
        + ". One seed: "
        "the intervals cover which problems were drawn, not training noise across seeds.",
        "",
        *comparison_lines(results, list(arms), prereg),
        "",
        "![primary metric](primary_metric.png)",
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
    ]
    lines += [
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


def _parameters(arms: dict[str, Path]) -> str:
    """Parameter split of the trained student, from its saved config."""
    cfg = json.loads((next(iter(arms.values())) / "final" / "config.json").read_text())
    h, i, layers, vocab = (cfg["hidden_size"], cfg["intermediate_size"],
                           cfg["num_hidden_layers"], cfg["vocab_size"])  # fmt: skip
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    kv_dim = h // heads * kv
    body = layers * (2 * h * h + 2 * h * kv_dim + 3 * h * i + 2 * h) + h
    embedding = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return (f"{(body + embedding) / 1e6:.2f}M parameters, {100 * body / (body + embedding):.0f}% "
            "outside the embeddings")  # fmt: skip
