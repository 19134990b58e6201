"""Training curves of one or more stage-2 runs from their metrics.jsonl, on one figure.

Each line of metrics.jsonl is one optimizer step: step, loss (over kept tokens), loss_all (over
all tokens), kept_fraction, mapped_fraction, tokens (cumulative), lr. The left panel shows
loss_all (solid) and loss (dashed) against tokens, the right one kept_fraction (solid) and
mapped_fraction (dotted). Runs are labelled by folder name.

A run still in progress may have a partly written last line: pipeline.metrics leaves it out with
a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from apps.analysis.configs import TrainingCurvesConfig
from pipeline.errors import VocagnoError
from pipeline.io import fingerprint, sha256_bytes
from pipeline.metrics import METRICS_NAME, read_json_lines

FIELDS = ("step", "tokens", "loss", "loss_all", "kept_fraction", "mapped_fraction", "lr")


@dataclass(frozen=True)
class RunMetrics:
    """One run's metrics as columns (NaN where a step logged null), and what reading noticed."""

    run_dir: Path
    columns: dict[str, np.ndarray]
    sha256: str  # of the bytes the columns came from
    warning: str | None = None

    @property
    def steps(self) -> int:
        return int(self.columns["step"].shape[0])


def read_metrics(run_dir: Path) -> RunMetrics:
    """Parse `run_dir/metrics.jsonl`; a partial last line is dropped with a warning."""
    path = Path(run_dir) / METRICS_NAME
    if not path.is_file():
        what = "run folder" if Path(run_dir).is_dir() else "folder"
        raise VocagnoError(f"no {METRICS_NAME} in {what} {run_dir}")
    log = read_json_lines(path)
    records, warning = log.records, log.warning
    for number, record in zip(log.line_numbers, records, strict=True):
        missing = [name for name in FIELDS if name not in record]
        if missing:
            raise VocagnoError(f"{path}: line {number} lacks {', '.join(missing)}")
    try:
        columns = {
            name: np.array([np.nan if r[name] is None else r[name] for r in records], dtype=float)
            for name in FIELDS
        }
    except (TypeError, ValueError) as exc:
        raise VocagnoError(f"{path}: a metric is not a number: {exc}") from None
    if not records:
        warning = warning or f"{path}: no steps logged yet"
    return RunMetrics(Path(run_dir), columns, sha256_bytes(log.data), warning)


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Folder names, or the paths as given where two runs share a folder name."""
    names = [Path(d).resolve().name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def plot_training_curves(config: TrainingCurvesConfig) -> list[RunMetrics]:
    """Read every run and write the figure to `config.out`; returns the runs as read."""
    from matplotlib.ticker import EngFormatter

    from apps.analysis.plotting import new_figure, save_png

    runs = [read_metrics(d) for d in config.run_dirs]
    if not any(run.steps for run in runs):
        raise VocagnoError("none of the runs has logged a step yet: nothing to plot")
    labels = run_labels(config.run_dirs)
    fig, (loss_ax, fraction_ax) = new_figure(ncols=2)
    for index, (run, label) in enumerate(zip(runs, labels, strict=True)):
        if not run.steps:
            continue
        color = f"C{index % 10}"
        tokens = run.columns["tokens"]
        loss_ax.plot(tokens, run.columns["loss_all"], "-", color=color, label=f"{label} loss_all")
        loss_ax.plot(tokens, run.columns["loss"], "--", color=color, label=f"{label} loss (kept)")
        fraction_ax.plot(
            tokens, run.columns["kept_fraction"], "-", color=color, label=f"{label} kept"
        )
        fraction_ax.plot(
            tokens, run.columns["mapped_fraction"], ":", color=color, label=f"{label} mapped"
        )
    loss_ax.set_ylabel("training loss (nats per token)")
    loss_ax.set_title("loss_all (solid), loss over kept tokens (dashed)", fontsize=10)
    fraction_ax.set_ylabel("fraction of student tokens")
    fraction_ax.set_ylim(0, 1.05)
    fraction_ax.set_title("kept (solid), mapped to the teacher (dotted)", fontsize=10)
    for ax in (loss_ax, fraction_ax):
        ax.set_xlabel("training tokens")
        ax.xaxis.set_major_formatter(EngFormatter())  # 200k, 1M: raw counts overlap
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    produced_from = [
        {"run": label, "sha256": run.sha256, "steps": run.steps}
        for run, label in zip(runs, labels, strict=True)
    ]
    save_png(fig, config.out, f"vocagno training_curves {fingerprint(produced_from)}")
    return runs
