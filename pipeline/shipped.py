"""Where the data that ships inside the package lives (see pipeline/assets/): the one place that
knows these paths."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# The package is installed from a source tree or a wheel, never zipped: a real folder.
ASSETS = Path(str(resources.files("pipeline") / "assets"))
CORPUS_SPLITS = ("train", "eval", "chat-train", "chat-eval")


def shipped_corpus(split: str) -> Path:
    """The GSM-style math corpus (`train`: 20,000 documents, `eval`: 1,000 held out), and its
    first 2,000 and 200 as chat records (`chat-train`, `chat-eval`: `--targets chat`)."""
    if split not in CORPUS_SPLITS:
        raise ValueError(f"shipped corpus split must be one of {CORPUS_SPLITS}, not {split!r}")
    return ASSETS / "corpus" / f"gsm_symbolic-{split}.jsonl.zst"


def shipped_tokenizer_file(file_name: str) -> Path:
    """A tokenizer.json.zst from pipeline/assets/tokenizers (names are in tokenizers.toml)."""
    return ASSETS / "tokenizers" / file_name
