"""Paths of the data that ships inside the package (see pipeline/assets/)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CORPUS_SPLITS = ("train", "eval")


def shipped_corpus(split: str) -> Path:
    """The GSM-style math corpus (`train`: 20,000 documents, `eval`: 1,000 held out)."""
    if split not in CORPUS_SPLITS:
        raise ValueError(f"shipped corpus split must be one of {CORPUS_SPLITS}, not {split!r}")
    return Path(
        str(resources.files("pipeline") / "assets" / "corpus" / f"gsm_symbolic-{split}.jsonl.zst")
    )
