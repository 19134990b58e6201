"""The dose-response's report: per warm start, its held-out loss, each arm's primary value, each
pre-registered difference with its paired bootstrap interval (apps.demo.comparison) per seed, and
the selection diagnostic; one plot of the differences against the warm start's held-out loss; and
the sentences the manifest asks for, whichever way they go."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from apps.analysis.plotting import new_figure, save_png
from apps.demo.comparison import METRICS, compare, value
from apps.demo.config import PreRegistration
from experiments.dose.config import DoseConfig
from pipeline.errors import ConfigError
from pipeline.io import atomic_write_json, atomic_write_text

DOSE_NAME = "dose.json"


def rung_folder(out: Path, steps: int) -> Path:
    """The folder of the warm start of `steps` steps, its arms and evaluations."""
    return Path(out) / f"warm-{steps:04d}"


def arm_name(arm: str, seed: int, lr: float | None = None) -> str:
    """An arm's run (and evaluation) at one seed and, in a learning-rate sweep, one peak rate."""
    return f"{arm}-seed{seed}" if lr is None else f"{arm}-lr{lr:g}-seed{seed}"


def heldout_path(rung: Path, name: str) -> Path:
    """The held-out loss of a swept run's final model, by which its arm's rate is chosen."""
    return rung / "heldout" / f"{name}.json"


def heldout_curve(rung: Path) -> list[tuple[int, float]]:
    """(step, held-out loss) as the warm start recorded them."""
    history = json.loads((rung / "warm-start" / "warm_start.json").read_text())["history"]
    return [(h["step"], h["heldout_loss"]) for h in history if "heldout_loss" in h]


def plateau(curve: list[tuple[int, float]], tolerance: float) -> dict:
    """The pre-registered test: the held-out loss fell by less than `tolerance` (a share) over
    the last quarter of the steps, from the last measurement at or before 3/4 of them."""
    last_step, last = curve[-1]
    quarter = [(s, h) for s, h in curve if s <= 0.75 * last_step]
    if not quarter:
        return {"tested": False, "flattened": None}
    start_step, start = quarter[-1]
    fall = (start - last) / start
    return {"tested": True, "from_step": start_step, "to_step": last_step, "from": start,
            "to": last, "relative_fall": fall, "flattened": fall < tolerance}  # fmt: skip


def load_results(config: DoseConfig) -> dict[int, dict]:
    """Per warm-start length: its held-out curve, evaluations and selection diagnostic."""
    results = {}
    for steps in config.warm_start_ladder:
        rung = rung_folder(config.out, steps)
        runs = [
            arm_name(arm, seed, lr)
            for seed in config.seeds_at(steps)
            for arm in config.arms
            for lr in config.arm_lrs or [None]
        ]
        results[steps] = {
            "heldout": heldout_curve(rung),
            "eval": {
                n: json.loads((rung / "eval" / f"{n}.json").read_text())
                for n in ["warm-start", *runs]
            },
            "best": {
                (arm, seed): best_run(config, rung, arm, seed)
                for seed in config.seeds_at(steps)
                for arm in config.arms
            },
            "selection": json.loads((rung / "selection" / "selection.json").read_text())[
                "statistics"
            ],
        }
    return results


def best_run(config: DoseConfig, rung: Path, arm: str, seed: int) -> tuple[str, float | None]:
    """The run an arm is compared by: its only one, or in a sweep the rate whose final model has
    the lowest held-out loss (never the primary metric: the comparison would then pick on the
    problems it is measured on). Its name and rate (None: the [stage2] rate)."""
    if not config.arm_lrs:
        return arm_name(arm, seed), None
    losses = {
        lr: json.loads(heldout_path(rung, arm_name(arm, seed, lr)).read_text())["heldout_loss"]
        for lr in config.arm_lrs
    }
    best = min(losses, key=losses.get)
    return arm_name(arm, seed, best), best


def dose_points(config: DoseConfig, prereg: PreRegistration, results: dict) -> list[dict]:
    """One record per warm start, seed and pre-registered comparison, on the primary metric."""
    primary = dataclasses.replace(prereg, secondary=[])
    points = []
    for steps, rung in results.items():
        for seed in config.seeds_at(steps):
            arms = {arm: rung["eval"][rung["best"][arm, seed][0]] for arm in config.arms}
            for row in compare(arms, primary):
                d = row.difference
                points.append({
                    "warm_start_steps": steps, "heldout_loss": rung["heldout"][-1][1],
                    "seed": seed, "comparison": f"{row.a}-{row.b}", "value_a": row.value_a,
                    "value_b": row.value_b, "difference": d.difference, "low": d.low,
                    "high": d.high, "excludes_zero": d.excludes_zero, "problems": d.problems,
                    "runs": [rung["best"][row.a, seed][0], rung["best"][row.b, seed][0]],
                })  # fmt: skip
    return points


def findings(
    config: DoseConfig, prereg: PreRegistration, points: list[dict], flat: dict, earlier: list[dict]
):
    """The sentences the manifest fixed, in its order; `earlier`: the points of earlier runs'
    warm starts (`[dose] earlier`), whose shortest may be the one the longest is set against."""
    confidence = round(100 * prereg.confidence)
    lines = []
    for steps in config.warm_start_ladder:
        parts = []
        for comparison in prereg.comparisons:
            mine = [p for p in points if p["warm_start_steps"] == steps
                    and p["comparison"] == comparison]  # fmt: skip
            mean = np.mean([p["difference"] for p in mine])
            established = sum(p["excludes_zero"] for p in mine)
            parts.append(f"`{comparison}` {mean:+.4f} ({established} of {len(mine)} excluding 0)")
        lines.append(f"- Warm start {steps}: " + "; ".join(parts) + ".")
    longest, every = config.warm_start_ladder[-1], [*points, *earlier]
    shortest = min(p["warm_start_steps"] for p in every)
    if flat["tested"]:
        verb = "passed" if flat["flattened"] else "failed: the plateau was not reached"
        lines.append(
            f"- Plateau test {verb} (held-out loss {flat['from']:.4f} at step {flat['from_step']}"
            f" -> {flat['to']:.4f} at step {flat['to_step']}: a fall of "
            f"{100 * flat['relative_fall']:.2f}%, against the {100 * config.plateau_tolerance:g}% "
            "pre-registered)."
        )
    else:
        lines.append("- Plateau test not possible: no held-out loss before the last quarter.")
    at = {steps: [p for p in every if p["warm_start_steps"] == steps
                  and p["comparison"] == "token-none"] for steps in (shortest, longest)}  # fmt: skip
    if at[longest]:
        helped = all(p["high"] < 0 for p in at[longest])
        hurt = all(p["low"] > 0 for p in at[longest])
        said = (
            "below zero in every seed with its interval excluding zero: guidance helped"
            if helped
            else "above zero in every seed with its interval excluding zero: guidance hurt"
            if hurt
            else f"not established either way at {confidence}% in every seed"
        )
        lines.append(f"- `token-none` at the longest warm start ({longest} steps) is {said}.")
    if at[longest] and at[shortest] and shortest != longest:
        change = np.mean([p["difference"] for p in at[longest]]) - np.mean(
            [p["difference"] for p in at[shortest]]
        )
        source = "" if shortest in config.warm_start_ladder else ", an earlier run's"
        lines.append(
            f"- `token-none` is {'smaller' if change < 0 else 'not smaller'} at the longest warm "
            f"start than at the shortest ({shortest} steps{source}; {change:+.4f} between their "
            "means)."
        )
    return lines


def plot_dose(points: list[dict], metric: str, dest: Path) -> None:
    comparisons = list(dict.fromkeys(p["comparison"] for p in points))
    fig, axes = new_figure(ncols=1, width_per_panel=6.5)
    ax = axes[0]
    for index, comparison in enumerate(comparisons):
        mine = [p for p in points if p["comparison"] == comparison]
        x = np.array([p["heldout_loss"] for p in mine]) + 0.01 * (index - len(comparisons) / 2)
        y = np.array([p["difference"] for p in mine])
        error = np.array([[p["difference"] - p["low"], p["high"] - p["difference"]] for p in mine])
        bars = ax.errorbar(x, y, yerr=error.T, fmt="o", ms=4, capsize=2, label=comparison)
        losses = sorted({p["heldout_loss"] for p in mine}, reverse=True)
        means = [np.mean([p["difference"] for p in mine if p["heldout_loss"] == h]) for h in losses]
        shifted = np.array(losses) + 0.01 * (index - len(comparisons) / 2)
        ax.plot(shifted, means, "-", lw=1, color=bars[0].get_color())  # the markers' colour
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.invert_xaxis()  # left to right: longer warm starts
    ax.set_xlabel("warm start's held-out loss (nats/token; right: trained longer)", fontsize=8)
    ax.set_ylabel(f"difference in {METRICS[metric].label}", fontsize=8)
    ax.set_title("below 0: the first arm is better", fontsize=9)
    ax.legend(fontsize=7)
    save_png(fig, dest, "vocagno dose-response: differences vs the warm start's held-out loss")


def rung_rows(config: DoseConfig, prereg: PreRegistration, results: dict, points: list[dict]):
    metric = METRICS[prereg.primary]
    header = (
        "| warm start (steps) | held-out loss | warm start | "
        + " | ".join(f"{arm} (mean)" for arm in config.arms)
        + " | "
        + " | ".join(
            f"{c}: per seed [{round(100 * prereg.confidence)}% interval]"
            for c in prereg.comparisons
        )  # fmt: skip
        + " |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for steps, rung in results.items():
        evals = rung["eval"]
        seeds = config.seeds_at(steps)
        cells = [f"{rung['heldout'][-1][1]:.4f}",
                 metric.fmt.format(value(evals["warm-start"], prereg.primary))]  # fmt: skip
        for arm in config.arms:
            best = [rung["best"][arm, s] for s in seeds]
            mean = metric.fmt.format(
                np.mean([value(evals[name], prereg.primary) for name, _ in best])
            )
            rates = ", ".join(f"{lr:g}" for _, lr in best if lr is not None)
            cells.append(f"{mean} (lr {rates})" if rates else mean)
        for comparison in prereg.comparisons:
            cells.append("; ".join(
                f"{p['difference']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]"
                for p in points if p["comparison"] == comparison and p["warm_start_steps"] == steps
            ))  # fmt: skip
        lines.append(f"| {steps} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The selection diagnostic of each warm start (`vocagno analyze selection`, the arms' "
        "shape):",
        "",
        "| warm start (steps) | kept loss share | random's | rank corr. excess ~ student loss "
        "| ~ minus teacher loss | seldom-kept types: share of tokens | of loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for steps, rung in results.items():
        s = rung["selection"]
        seldom = s["seldom_kept"]
        lines.append(
            f"| {steps} | {s['kept_loss_share']:.1%} | {s['random_loss_share']:.1%} | "
            f"{s['excess_vs_student_loss']:+.2f} | {s['excess_vs_minus_teacher_loss']:+.2f} | "
            f"{seldom['token_share']:.1%} ({seldom['types']} types) | {seldom['loss_share']:.1%} |"
        )
    return lines


# What the report reads of each point of an earlier run (its plot and its findings).
POINT_FIELDS = {"warm_start_steps": int, "comparison": str, "heldout_loss": float,
                "difference": float, "low": float, "high": float}  # fmt: skip


def earlier_points(config: DoseConfig) -> list[dict]:
    """The points of `[dose] earlier` runs at warm starts this run does not have; ConfigError
    naming the file where one is no dose.json this report can read (checked before the first
    step, as the report reads them last)."""
    points = []
    for path in config.earlier:
        try:
            found = json.loads(Path(path).read_text())["points"]
            for point in found:
                for name, kind in POINT_FIELDS.items():
                    if not isinstance(point[name], kind if kind is not float else (int, float)):
                        raise TypeError(f"{name} is {point[name]!r}")
        except (ValueError, KeyError, TypeError, OSError) as exc:
            problem = f"no {exc}" if isinstance(exc, KeyError) else exc
            raise ConfigError(
                f"[dose] earlier {path} is no dose.json this design's report reads ({problem})"
            ) from None
        points += found
    return [p for p in points if p["warm_start_steps"] not in config.warm_start_ladder]


def write_dose_report(
    config: DoseConfig, manifest: Path, prereg: PreRegistration, timings: dict
) -> Path:
    results = load_results(config)
    points = dose_points(config, prereg, results)
    earlier = earlier_points(config)
    longest = config.warm_start_ladder[-1]
    flat = plateau(results[longest]["heldout"], config.plateau_tolerance)
    atomic_write_json(
        config.out / DOSE_NAME,
        {"points": points, "plateau": flat, "timings": timings,
         "heldout": {steps: r["heldout"] for steps, r in results.items()},
         "arm_lrs": config.arm_lrs, "earlier": config.earlier,
         "selection": {steps: r["selection"] for steps, r in results.items()}},
    )  # fmt: skip
    plot_dose([*earlier, *points], prereg.primary, config.out / "dose.png")
    seconds = sum(v for k, v in timings.items() if k != "cpu")
    lines = [
        "# vocagno dose-response",
        "",
        f"Manifest: `{manifest}` (pre-registered before the first run). Everything below was "
        f"measured by this run. Primary metric: {METRICS[prereg.primary].label}.",
        *(["", "The plot also draws the warm starts of earlier runs, each measured by its own run: "
           + ", ".join(f"`{path}`" for path in config.earlier) + "."] if earlier else []),
        "",
        *findings(config, prereg, points, flat, earlier),
        "",
        *rung_rows(config, prereg, results, points),
        "",
        f"Wall time of the steps this folder's runs did: {seconds / 60:.1f} min "
        "(`timings.json`, each step from the run that did it).",
        "",
        "![dose-response](dose.png)",
    ]
    dest = config.out / "report.md"
    atomic_write_text(dest, "\n".join(lines) + "\n")
    return dest
