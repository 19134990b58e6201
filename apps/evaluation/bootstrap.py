"""Paired bootstrap over problems: an interval for the difference of two models' metric.

Both models are measured on the same problems, so problems are resampled together (one index set
per resample for both): the interval reflects which problems happened to be drawn, not a second,
independent draw per model. The metric of a resample is a weighted mean, sum(w * x) / sum(w)
(weights 1: a plain mean; weights = characters: a per-character rate over all problems).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Difference:
    difference: float  # metric(a) - metric(b) on all problems
    low: float
    high: float
    confidence: float
    resamples: int
    problems: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def to_json(self) -> dict:
        return {**self.__dict__, "excludes_zero": self.excludes_zero}


def paired_bootstrap(
    a: np.ndarray,
    b: np.ndarray,
    weights: np.ndarray | None = None,
    *,
    resamples: int = 10_000,
    seed: int = 0,
    confidence: float = 0.95,
    chunk: int = 1000,
) -> Difference:
    """Percentile interval of metric(a) - metric(b), resampling problems with replacement."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    w = np.ones_like(a) if weights is None else np.asarray(weights, dtype=np.float64)
    if not (a.shape == b.shape == w.shape) or a.ndim != 1 or len(a) == 0:
        raise ValueError("a, b and weights must be equal-length, non-empty 1-d arrays")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")
    per_problem = w * (a - b)  # the difference of weighted means shares its denominator
    rng = np.random.default_rng(seed)
    samples = np.empty(resamples)
    for begin in range(0, resamples, chunk):  # bounded memory: chunk x problems indices
        idx = rng.integers(0, len(a), size=(min(chunk, resamples - begin), len(a)))
        samples[begin : begin + len(idx)] = per_problem[idx].sum(1) / w[idx].sum(1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return Difference(
        difference=float(per_problem.sum() / w.sum()),
        low=float(low),
        high=float(high),
        confidence=confidence,
        resamples=resamples,
        problems=len(a),
    )
