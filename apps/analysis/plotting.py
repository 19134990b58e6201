"""The one place figures are made and saved: headless backend, one size and resolution, atomic PNG.

PNG text chunks carry the producer's fingerprint, so a figure found on its own still says what
made it.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI; must precede the pyplot import

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pipeline.io import atomic_path  # noqa: E402

DPI = 120


def new_figure(ncols: int = 1, width_per_panel: float = 5.5, height: float = 4.0):
    """(figure, list of axes) side by side."""
    fig, axes = plt.subplots(1, ncols, figsize=(width_per_panel * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_png(fig: Figure, dest: str | os.PathLike, description: str) -> None:
    """Write `fig` as a PNG atomically and free it; `description` goes into the PNG's metadata."""
    fig.tight_layout()
    with atomic_path(dest) as tmp:
        fig.savefig(
            tmp,
            format="png",
            dpi=DPI,
            metadata={"Software": "vocagno", "Description": description},
        )
    plt.close(fig)
