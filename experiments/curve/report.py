"""The guidance curve's report: each pre-registered difference on the primary metric (a paired
bootstrap interval over the same problems, apps.demo.comparison) at every checkpoint and seed,
against tokens trained; one plot, one table, and plain sentences on what it shows, either way."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from apps.analysis.plotting import new_figure, save_png
from apps.demo.comparison import METRICS, compare, value
from apps.demo.config import PreRegistration
from experiments.curve.config import CurveConfig
from pipeline.io import atomic_write_json, atomic_write_text

CURVE_NAME = "curve.json"


def point_name(arm: str, seed: int, step: int) -> str:
    """The evaluation of `arm` trained with `seed` to `step` (OUT/eval/NAME.json)."""
    return f"{arm}-seed{seed}-step{step}"


def curve_points(
    config: CurveConfig, prereg: PreRegistration, results: dict, tokens_per_step: int
) -> list[dict]:
    """One record per checkpoint, seed and pre-registered comparison, on the primary metric."""
    primary = dataclasses.replace(prereg, secondary=[])
    points = []
    for step in config.checkpoints:
        for seed in config.seeds:
            arms = {arm: results[point_name(arm, seed, step)] for arm in config.arms}
            for row in compare(arms, primary):
                d = row.difference
                points.append({
                    "step": step, "tokens": step * tokens_per_step, "seed": seed,
                    "comparison": f"{row.a}-{row.b}", "value_a": row.value_a,
                    "value_b": row.value_b, "difference": d.difference, "low": d.low,
                    "high": d.high, "excludes_zero": d.excludes_zero, "problems": d.problems,
                })  # fmt: skip
    return points


def arm_values(config: CurveConfig, metric: str, results: dict, step: int) -> dict[str, list]:
    """Each arm's primary value at `step`, seed by seed."""
    return {
        arm: [value(results[point_name(arm, seed, step)], metric) for seed in config.seeds]
        for arm in config.arms
    }


def findings(config: CurveConfig, prereg: PreRegistration, results: dict, points: list[dict]):
    """Plain sentences: which arm led at the largest budget, and whether the seeds agree."""
    metric, last = METRICS[prereg.primary], config.checkpoints[-1]
    confidence = round(100 * prereg.confidence)
    values = {
        arm: float(np.mean(v))
        for arm, v in arm_values(config, prereg.primary, results, last).items()
    }
    pick = min if metric.lower_is_better else max
    leader = pick(values, key=values.get)
    lines = [
        f"At the largest budget (step {last}), `{leader}` had the best {metric.label} averaged "
        f"over the {len(config.seeds)} seeds ({metric.fmt.format(values[leader])}; "
        + ", ".join(f"`{arm}` {metric.fmt.format(v)}" for arm, v in values.items()) + ")."
    ]  # fmt: skip
    for comparison in dict.fromkeys(p["comparison"] for p in points):
        at_last = [p for p in points if p["comparison"] == comparison and p["step"] == last]
        below = sum(p["difference"] < 0 for p in at_last)
        established = sum(p["excludes_zero"] for p in at_last)
        agree = (
            "the seeds agree on its sign"
            if below in (0, len(at_last))
            else "the seeds disagree on its sign"
        )
        mean = np.mean([p["difference"] for p in at_last])
        lines.append(
            f"- `{comparison}` at step {last}: mean {mean:+.4f}; negative in {below} of "
            f"{len(at_last)} seeds, {agree}; its {confidence}% interval excludes zero in "
            f"{established} of them."
        )
    return lines


def plot_curve(points: list[dict], metric: str, dest: Path) -> None:
    comparisons = list(dict.fromkeys(p["comparison"] for p in points))
    fig, axes = new_figure(ncols=len(comparisons), width_per_panel=5.0)
    for ax, comparison in zip(axes, comparisons, strict=True):
        mine = [p for p in points if p["comparison"] == comparison]
        seeds = sorted({p["seed"] for p in mine})
        for index, seed in enumerate(seeds):
            per_seed = [p for p in mine if p["seed"] == seed]
            shift = 1.0 + 0.04 * (index - (len(seeds) - 1) / 2)  # seeds side by side on a log axis
            x = np.array([p["tokens"] for p in per_seed]) * shift
            y = np.array([p["difference"] for p in per_seed])
            error = np.array(
                [[p["difference"] - p["low"], p["high"] - p["difference"]] for p in per_seed]
            ).T
            ax.errorbar(x, y, yerr=error, fmt="o", ms=3, capsize=2, alpha=0.7, label=f"seed {seed}")
        tokens = sorted({p["tokens"] for p in mine})
        means = [np.mean([p["difference"] for p in mine if p["tokens"] == t]) for t in tokens]
        ax.plot(tokens, means, "k-", lw=1.5, label="mean over seeds")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("student tokens trained", fontsize=8)
        ax.set_ylabel(f"{comparison}: {METRICS[metric].label}", fontsize=8)
        ax.set_title(f"{comparison} (below 0: the first arm is better)", fontsize=9)
        ax.legend(fontsize=7)
    save_png(fig, dest, "vocagno guidance curve: pre-registered differences vs tokens trained")


def write_curve_report(
    config: CurveConfig, manifest: Path, prereg: PreRegistration, results: dict,
    timings: dict, tokens_per_step: int,
) -> Path:  # fmt: skip
    points = curve_points(config, prereg, results, tokens_per_step)
    atomic_write_json(config.out / CURVE_NAME, {"points": points, "timings": timings})
    plot_curve(points, prereg.primary, config.out / "curve.png")
    metric = METRICS[prereg.primary]
    warm = metric.fmt.format(value(results["warm-start"], prereg.primary))
    comparisons = list(dict.fromkeys(p["comparison"] for p in points))
    header = (
        "| step | tokens | "
        + " | ".join(f"{arm} (mean)" for arm in config.arms)
        + " | "
        + " | ".join(
            f"{c}: per seed [{round(100 * prereg.confidence)}% interval]" for c in comparisons
        )
        + " |"
    )
    lines = [
        "# vocagno guidance curve",
        "",
        f"Manifest: `{manifest}` (pre-registered before the first run). Everything below was "
        "measured by this run.",
        "",
        f"Primary metric: {metric.label}; the warm start every arm continues from: {warm}.",
        "",
        *findings(config, prereg, results, points),
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for step in config.checkpoints:
        values = arm_values(config, prereg.primary, results, step)
        cells = [metric.fmt.format(np.mean(v)) for v in values.values()]
        for comparison in comparisons:
            cells.append("; ".join(
                f"{p['difference']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]"
                for p in points if p["comparison"] == comparison and p["step"] == step
            ))  # fmt: skip
        lines.append(f"| {step} | {step * tokens_per_step:,} | " + " | ".join(cells) + " |")
    seconds = sum(v for k, v in timings.items() if k != "cpu")
    lines += ["", f"Wall time of the steps this folder's runs did: {seconds / 60:.1f} min "
              "(`timings.json`, each step from the run that did it).", "", "![curve](curve.png)"]  # fmt: skip
    dest = config.out / "report.md"
    atomic_write_text(dest, "\n".join(lines) + "\n")
    return dest
