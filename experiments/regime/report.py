"""The regime experiment's report (OUT/report.md, OUT/regime.json, OUT/regime.png): the warm
start's curve and plateau test, the regime gate, each arm's rate as the validation part chose it,
every pre-registered comparison per seed and over the seeds, the selection diagnostic, and the
sentences the manifest fixed, whichever way they go."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from apps.demo.comparison import METRICS, per_item, value
from apps.evaluation.bootstrap import paired_bootstrap
from experiments.dose.report import heldout_curve, plateau
from experiments.regime.config import RegimeConfig, RegimePreRegistration
from pipeline.io import atomic_write_json, atomic_write_text


def _eval(config: RegimeConfig, name: str, part: str) -> dict | None:
    path = config.out / "eval" / f"{name}-{part}.json"
    return json.loads(path.read_text()) if path.exists() else None


def gate(config: RegimeConfig, prereg: RegimePreRegistration) -> dict:
    """The pre-registered gate: the warm start's plateau test passed, and the teacher's test
    bits per character is at least `gate_margin` below the warm start's; written to OUT/gate.json."""
    flat = plateau(heldout_curve(config.out), config.plateau_tolerance)
    teacher, warm = _eval(config, "teacher", "test"), _eval(config, "warm-start", "test")
    xt, w = per_item(teacher, "bits_per_character")
    xw, _ = per_item(warm, "bits_per_character")
    gap = paired_bootstrap(xw, xt, w, resamples=prereg.resamples, seed=prereg.seed,
                           confidence=prereg.confidence)  # fmt: skip
    teacher_bpc, warm_bpc = value(teacher, "bits_per_character"), value(warm, "bits_per_character")
    relative = (warm_bpc - teacher_bpc) / warm_bpc
    wide = relative >= config.gate_margin
    passed = bool(flat["flattened"]) and wide
    needs = []
    if not flat["flattened"]:
        needs.append("a longer warm start (its held-out loss still fell "
                     f"{flat.get('relative_fall', float('nan')):.2%} over its last quarter; "
                     "raise warm_start_max_steps)")  # fmt: skip
    if not wide:
        needs.append(f"a teacher at most {warm_bpc * (1 - config.gate_margin):.4f} bits/char on "
                     f"the test part (it has {teacher_bpc:.4f}), or a weaker student")  # fmt: skip
    result = {
        "passed": passed, "plateau": flat, "teacher_bits_per_character": teacher_bpc,
        "warm_start_bits_per_character": warm_bpc, "relative_gap": relative,
        "margin": config.gate_margin, "gap": gap.to_json(), "would_pass_with": needs,
    }  # fmt: skip
    atomic_write_json(config.out / "gate.json", result)
    return result


def _seed_mean(config: RegimeConfig, arm: str, lr: float, seeds: list[int]) -> dict | None:
    """A result whose per-document values are the arm's averaged over `seeds` (documents and
    their weights are the same in every seed's evaluation)."""
    from experiments.regime.run import run_name

    results = [_eval(config, run_name(arm, lr, s), "test") for s in seeds]
    if any(r is None for r in results):
        return None
    merged = {}
    bpc = [r["bits_per_character"] for r in results]
    merged["bits_per_character"] = {
        "per_document_characters": bpc[0]["per_document_characters"],
        "per_document_bits": list(np.mean([b["per_document_bits"] for b in bpc], axis=0)),
    }
    if all("last_word_accuracy" in r for r in results):
        lwa = [r["last_word_accuracy"] for r in results]
        merged["last_word_accuracy"] = {
            "per_document_words": lwa[0]["per_document_words"],
            "per_document_correct": list(
                np.mean([x["per_document_correct"] for x in lwa], axis=0)
            ),
        }
    return merged


def _chosen(config: RegimeConfig) -> dict[str, dict]:
    """Each arm's rate (the lower validation bits/char at seed 0) and the values behind it."""
    from experiments.regime.run import run_name

    chosen = {}
    for arm in config.arms:
        values = {}
        for lr in config.rates:
            result = _eval(config, run_name(arm, lr, config.rate_seed), "validation")
            if result is not None:
                values[lr] = value(result, "bits_per_character")
        if len(values) == len(config.rates):
            chosen[arm] = {"lr": min(config.rates, key=values.__getitem__), "validation": values}
    return chosen


def comparisons(config: RegimeConfig, prereg: RegimePreRegistration, chosen: dict) -> list[dict]:
    """Every pre-registered comparison and metric, per shared seed and over the shared seeds."""
    from experiments.regime.run import run_name

    rows = []
    for a, b in prereg.pairs(tuple(config.arms)):
        if a not in chosen or b not in chosen:
            continue
        shared = [s for s in config.seeds_of(a) if s in config.seeds_of(b)]
        runs = {f"seed {s}": (_eval(config, run_name(a, chosen[a]["lr"], s), "test"),
                              _eval(config, run_name(b, chosen[b]["lr"], s), "test"))
                for s in shared}  # fmt: skip
        if len(shared) > 1:
            runs["over seeds"] = (_seed_mean(config, a, chosen[a]["lr"], shared),
                                  _seed_mean(config, b, chosen[b]["lr"], shared))  # fmt: skip
        for label, (ra, rb) in runs.items():
            if ra is None or rb is None:
                continue
            for metric in (prereg.primary, *prereg.secondary):
                if metric not in ra or metric not in rb:
                    continue
                xa, w = per_item(ra, metric)
                xb, _ = per_item(rb, metric)
                d = paired_bootstrap(xa, xb, w, resamples=prereg.resamples, seed=prereg.seed,
                                     confidence=prereg.confidence)  # fmt: skip
                rows.append({"a": a, "b": b, "seeds": label, "metric": metric,
                             "value_a": value(ra, metric), "value_b": value(rb, metric),
                             **d.to_json()})  # fmt: skip
    return rows


def _signed(x: float) -> str:
    """+0.0123; a difference too small for four decimals keeps its digits (-2.28e-05)."""
    return f"{x:+.4f}" if x == 0 or abs(x) >= 5e-4 else f"{x:+.2e}"


def _said(row: dict) -> str:
    lower = METRICS[row["metric"]].lower_is_better
    if not row["excludes_zero"]:
        return "no difference established"
    a_better = row["difference"] < 0 if lower else row["difference"] > 0
    return f"`{row['a'] if a_better else row['b']}` better"


def findings(config: RegimeConfig, prereg: RegimePreRegistration, rows: list[dict]) -> list[str]:
    """The sentences the manifest fixed: per comparison with `none`, on each metric over the
    seeds (one seed where the arm has one), whether the cache's arm helped, hurt, or neither."""
    lines = []
    for metric in (prereg.primary, *prereg.secondary):
        for row in rows:
            if row["metric"] != metric or row["b"] != "none":
                continue
            several = any(r["a"] == row["a"] and r["b"] == "none" and r["seeds"] == "over seeds"
                          for r in rows)  # fmt: skip
            if several and row["seeds"] != "over seeds":
                continue
            lower = METRICS[metric].lower_is_better
            better = row["difference"] < 0 if lower else row["difference"] > 0
            if not row["excludes_zero"]:
                outcome = "neither helped nor hurt (the interval includes zero)"
            else:
                outcome = "helped" if better else "hurt"
            lines.append(
                f"- {METRICS[metric].label}: `{row['a']}` − `none` = {_signed(row['difference'])} "
                f"[{_signed(row['low'])}, {_signed(row['high'])}] ({row['seeds']}): the cache's arm "
                f"{outcome}."
            )
    return lines


def _repetition(history: list[dict], flat: dict) -> list[str]:
    """How much of the last quarter's flattening is the student memorizing its repeated data:
    the loss on its own training rows against the held-out loss, over the plateau test's steps."""
    at = {h["step"]: h for h in history if "heldout_loss" in h}
    if not flat.get("tested") or "train_rows_loss" not in at[flat["to_step"]]:
        return []
    first, last = at[flat["from_step"]], at[flat["to_step"]]
    held = (first["heldout_loss"] - last["heldout_loss"]) / first["heldout_loss"]
    train = (first["train_rows_loss"] - last["train_rows_loss"]) / first["train_rows_loss"]
    return [
        f"Repetition: over the same last quarter the loss on its own training rows fell "
        f"{train:.2%} against the held-out loss's {held:.2%}; the gap between them (held-out "
        f"minus training rows) went from {first['heldout_loss'] - first['train_rows_loss']:.4f} "
        f"to {last['heldout_loss'] - last['train_rows_loss']:.4f} nats/token"
        + (": a growing share of what it still learns is text it has seen." if train > held
           else ": it learned new text as fast as seen text.")  # fmt: skip
    ]


def _plot(config: RegimeConfig, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = json.loads((config.out / "warm-start" / "warm_start.json").read_text())["history"]
    points = [h for h in history if "heldout_loss" in h]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([h["step"] for h in points], [h["heldout_loss"] for h in points], "o-", ms=3,
            label="held-out (validation part)")  # fmt: skip
    ax.plot([h["step"] for h in points], [h["train_rows_loss"] for h in points], "s--", ms=3,
            label="its own training rows")  # fmt: skip
    ax.set_xlabel("warm-start step (2,048 tokens each)")
    ax.set_ylabel("next-token loss (nats/token)")
    ax.set_title("the warm start: training until the plateau test passes", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=120)
    plt.close(fig)


def write_regime_report(
    config: RegimeConfig, manifest: Path, prereg: RegimePreRegistration, seconds: dict
) -> Path:
    verdict = gate(config, prereg)
    chosen = _chosen(config) if verdict["passed"] else {}
    rows = comparisons(config, prereg, chosen)
    selection = config.out / "selection" / "selection.json"
    diagnostic = json.loads(selection.read_text()) if selection.exists() else None
    warm = json.loads((config.out / "warm-start" / "warm_start.json").read_text())
    _plot(config, config.out / "regime.png")
    flat, gap = verdict["plateau"], verdict["gap"]
    lines = [
        "# The method in its own regime: report",
        "",
        f"Manifest: `{manifest}` (its header is the pre-registration). Corpus `{config.corpus}`, "
        f"splits by seed {config.split_seed}: test {config.test_docs}, validation "
        f"{config.validation_docs}, continual pretraining {config.cpt_docs}, warm start the rest.",
        "",
        "## The warm start",
        "",
        f"{config.student} trained plainly for {warm['steps']} steps "
        f"({warm['tokens_trained']:,} tokens, {warm['tokens_trained'] / warm['tokens_available']:.1f} "
        f"passes over its {warm['tokens_available']:,}). Plateau test: held-out loss "
        f"{flat.get('from', float('nan')):.4f} at step {flat.get('from_step')} → "
        f"{flat.get('to', float('nan')):.4f} at step {flat.get('to_step')}, a fall of "
        f"{flat.get('relative_fall', float('nan')):.2%}: "
        f"{'passed' if flat['flattened'] else 'failed'} (tolerance "
        f"{config.plateau_tolerance:.0%}).",
        "",
        *_repetition(warm["history"], flat),
        "",
        "| step | held-out loss | loss on its own training rows |",
        "|---:|---:|---:|",
        *(f"| {h['step']} | {h['heldout_loss']:.4f} | {h['train_rows_loss']:.4f} |"
          for h in warm["history"] if "heldout_loss" in h),
        "",
        "![the warm start's curve](regime.png)",
        "",
        "## The regime gate",
        "",
        f"Test part, bits per character: teacher {verdict['teacher_bits_per_character']:.4f}, "
        f"warm start {verdict['warm_start_bits_per_character']:.4f}; the teacher is "
        f"{verdict['relative_gap']:.1%} below (the gate needs {config.gate_margin:.0%}); warm "
        f"start − teacher {gap['difference']:+.4f}, {round(100 * gap['confidence'])}% interval "
        f"[{gap['low']:+.4f}, {gap['high']:+.4f}] over {gap['problems']} chapters.",
        "",
        f"**The gate {'passed' if verdict['passed'] else 'failed'}.**"
        + ("" if verdict["passed"] else " It would pass with: "
           + "; ".join(verdict["would_pass_with"]) + ". No arm was trained, and no arm result "
           "is this regime's."),
        "",
    ]  # fmt: skip
    if diagnostic is not None:
        lines += ["## The selection diagnostic at the warm start", "",
                  f"`vocagno analyze selection` (OUT/selection/selection.md): "
                  f"{json.dumps(_diagnostic_summary(diagnostic))}", ""]  # fmt: skip
    if chosen:
        lines += ["## Each arm's rate, chosen on the validation part (seed "
                  f"{config.rate_seed})", "", "| arm | " + " | ".join(
                      f"validation bits/char at {lr:g}" for lr in config.rates) + " | chosen |",
                  "|---|" + "---:|" * len(config.rates) + "---:|"]  # fmt: skip
        for arm, pick in chosen.items():
            lines.append(f"| {arm} | " + " | ".join(f"{pick['validation'][lr]:.4f}"
                                                   for lr in config.rates)
                         + f" | {pick['lr']:g} |")  # fmt: skip
        lines += ["", "## Test part, each arm at its chosen rate", "",
                  "| arm | seed | bits/char (primary) | last-word accuracy |", "|---|---:|---:|---:|"]
        from experiments.regime.run import run_name

        for arm, pick in chosen.items():
            for seed in config.seeds_of(arm):
                result = _eval(config, run_name(arm, pick["lr"], seed), "test")
                if result is not None:
                    lines.append(f"| {arm} | {seed} | {value(result, 'bits_per_character'):.4f} "
                                 f"| {value(result, 'last_word_accuracy'):.4f} |")  # fmt: skip
        teacher = _eval(config, "teacher", "test")
        warm_result = _eval(config, "warm-start", "test")
        for name, result in (("warm start", warm_result), ("teacher", teacher)):
            lines.append(f"| {name} | – | {value(result, 'bits_per_character'):.4f} | "
                         f"{value(result, 'last_word_accuracy'):.4f} |")  # fmt: skip
        pct = round(100 * prereg.confidence)
        lines += ["", "## The pre-registered comparisons", "",
                  f"Paired bootstrap over the {config.test_docs} test chapters "
                  f"({prereg.resamples:,} resamples, seed {prereg.seed}); difference = first − "
                  "second; 'over seeds' averages each chapter's value over the shared seeds.", "",
                  f"| metric | comparison | seeds | difference | {pct}% interval | says |",
                  "|---|---|---|---:|---:|---|"]  # fmt: skip
        for row in rows:
            lines.append(f"| {row['metric']} | {row['a']} − {row['b']} | {row['seeds']} | "
                         f"{_signed(row['difference'])} | [{_signed(row['low'])}, "
                         f"{_signed(row['high'])}] | "
                         f"{_said(row)} |")  # fmt: skip
        lines += ["", "## What it says", "", *findings(config, prereg, rows)]
    lines += ["", "## Timings (wall seconds of the run that did each step)", "",
              "```", json.dumps(seconds, indent=1), "```", ""]  # fmt: skip
    report = config.out / "report.md"
    atomic_write_text(report, "\n".join(lines))
    atomic_write_json(config.out / "regime.json", {"gate": verdict, "chosen": {
        arm: {"lr": pick["lr"], "validation": {str(k): v for k, v in pick["validation"].items()}}
        for arm, pick in chosen.items()}, "comparisons": rows,
        "selection": None if diagnostic is None else _diagnostic_summary(diagnostic),
        "seconds": seconds})  # fmt: skip
    return report


def _diagnostic_summary(diagnostic: dict) -> dict:
    """The figures docs/dose-response.md sets side by side: the kept tokens' share of the
    student's loss against random's, and the rank correlations of excess loss."""
    keys = ("kept_loss_share", "random_loss_share", "student_loss_mean", "teacher_loss_mean",
            "excess_vs_student_loss", "excess_vs_minus_teacher_loss")  # fmt: skip
    statistics = diagnostic.get("statistics", diagnostic)
    return {key: statistics[key] for key in keys if key in statistics}
