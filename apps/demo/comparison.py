"""The demo's pre-registered comparison: each metric per model, and each difference between two
arms with a paired bootstrap interval over the same held-out problems (or documents).

Nothing here judges which arm should win; `verdict` states which did on the primary metric and
whether the interval of each primary comparison excludes zero, whichever way that goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from apps.demo.config import PreRegistration
from apps.evaluation.bootstrap import Difference, paired_bootstrap


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    lower_is_better: bool
    fmt: str


METRICS = {
    "answer_bits": Metric(
        "answer_bits", "answer bits per character given the question", True, "{:.4f}"
    ),
    "answer_accuracy": Metric("answer_accuracy", "answer accuracy (greedy)", False, "{:.3f}"),
    "bits_per_character": Metric(
        "bits_per_character", "bits per character, whole documents", True, "{:.4f}"
    ),
    "last_word_accuracy": Metric(
        "last_word_accuracy", "greedy last-word accuracy (line ends)", False, "{:.4f}"
    ),
}


def per_item(result: dict, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-problem (or per-document) values and weights; the metric is sum(w*x)/sum(w)."""
    if metric == "answer_bits":
        bits = np.asarray(result["answer_bits"]["per_problem_bits"], dtype=np.float64)
        chars = np.asarray(result["answer_bits"]["per_problem_characters"], dtype=np.float64)
        return bits / chars, chars
    if metric == "answer_accuracy":
        correct = [o["correct"] for o in result["answer_accuracy"]["outcomes"]]
        return np.asarray(correct, dtype=np.float64), np.ones(len(correct))
    if metric == "bits_per_character":
        bpc = result["bits_per_character"]
        bits = np.asarray(bpc["per_document_bits"], dtype=np.float64)
        chars = np.asarray(bpc["per_document_characters"], dtype=np.float64)
        return bits / chars, chars
    if metric == "last_word_accuracy":
        lwa = result["last_word_accuracy"]
        words = np.asarray(lwa["per_document_words"], dtype=np.float64)
        correct = np.asarray(lwa["per_document_correct"], dtype=np.float64)
        return correct / np.maximum(words, 1), words
    raise ValueError(f"unknown metric {metric!r}")


def value(result: dict, metric: str) -> float:
    x, w = per_item(result, metric)
    return float((x * w).sum() / w.sum())


@dataclass(frozen=True)
class Row:
    metric: str
    a: str
    b: str
    value_a: float
    value_b: float
    difference: Difference

    @property
    def better(self) -> str:
        """The arm with the better point value ('tie' when equal)."""
        d = self.difference.difference
        if d == 0:
            return "tie"
        a_better = d < 0 if METRICS[self.metric].lower_is_better else d > 0
        return self.a if a_better else self.b


def compare(
    results: dict[str, dict], prereg: PreRegistration, pairs: list[tuple[str, str]] | None = None
) -> list[Row]:
    """Each metric's difference for each pair (`pairs`; default: the comparisons of guidance
    modes) that both results measured."""
    rows = []
    for metric in (prereg.primary, *prereg.secondary):
        for a, b in prereg.pairs() if pairs is None else pairs:
            if metric not in _present(results[a]) or metric not in _present(results[b]):
                continue
            xa, w = per_item(results[a], metric)
            xb, wb = per_item(results[b], metric)
            if not np.array_equal(w, wb):
                raise ValueError(f"{a} and {b} were not measured on the same items of {metric}")
            diff = paired_bootstrap(
                xa, xb, w, resamples=prereg.resamples, seed=prereg.seed,
                confidence=prereg.confidence,
            )  # fmt: skip
            rows.append(
                Row(metric, a, b, value(results[a], metric), value(results[b], metric), diff)
            )
    return rows


def _present(result: dict) -> set[str]:
    return {m for m in METRICS if m in result}


def best_arm(results: dict[str, dict], arms: list[str], metric: str) -> str:
    values = {arm: value(results[arm], metric) for arm in arms}
    pick = min if METRICS[metric].lower_is_better else max
    return pick(values, key=values.get)


def verdict(results: dict[str, dict], arms: list[str], rows: list[Row], primary: str) -> list[str]:
    """Plain sentences: which arm won on the primary metric, and what each interval says."""
    metric = METRICS[primary]
    direction = "lower" if metric.lower_is_better else "higher"
    winner = best_arm(results, arms, primary)
    lines = [
        f"On the primary metric ({metric.label}; {direction} is better), `{winner}` had the best "
        f"value of the arms ({metric.fmt.format(value(results[winner], primary))})."
    ]
    for row in rows:
        if row.metric != primary:
            continue
        d = row.difference
        ci = f"[{d.low:+.4f}, {d.high:+.4f}]"
        if d.excludes_zero:
            said = f"the interval excludes zero: `{row.better}` is better on these problems"
        else:
            said = "the interval includes zero: no difference is established"
        lines.append(
            f"- `{row.a}` − `{row.b}` = {d.difference:+.4f}, {round(100 * d.confidence)}% "
            f"interval {ci} over {d.problems} problems; {said}."
        )
    return lines
