"""What the stage-2 comparisons of benchmarks/ share: train an arm with stage 2's entry script as
a user runs it (kept once finished, so a rerun trains nothing twice), and the paired bootstrap of
two arms' per-document rates (apps.evaluation.bootstrap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from apps.evaluation.bootstrap import paired_bootstrap

ROOT = Path(__file__).resolve().parents[1]


def train_arm(out: Path, args: list[str]) -> Path:
    """OUT/final of `stage2_train/train.py ARGS --out OUT`, its log beside OUT."""
    if (out / "final").exists():
        return out / "final"
    command = [sys.executable, str(ROOT / "stage2_train/train.py"), *args, "--out", str(out)]
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return out / "final"


def rate_difference(a_bits, a_characters, b_bits, b_characters) -> str:
    """metric(a) - metric(b) for a per-character rate over the same documents, with its 95%
    interval: "+d [low, high]"."""
    x = np.asarray(a_bits) / np.asarray(a_characters)
    y = np.asarray(b_bits) / np.asarray(b_characters)
    d = paired_bootstrap(x, y, np.asarray(a_characters))
    return f"{d.difference:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"
