"""Where the data that ships inside the package lives (see pipeline/assets/): the one place that
knows these paths."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# The package is installed from a source tree or a wheel, never zipped: a real folder.
ASSETS = Path(str(resources.files("pipeline") / "assets"))
CORPUS_FILES = {
    "train": "gsm_symbolic-train.jsonl.zst",
    "eval": "gsm_symbolic-eval.jsonl.zst",
    "chat-train": "gsm_symbolic-chat-train.jsonl.zst",
    "chat-eval": "gsm_symbolic-chat-eval.jsonl.zst",
    "kjv": "kjv-chapters.jsonl.zst",
    "novels": "novels-chapters.jsonl.zst",
}
CORPUS_SPLITS = tuple(CORPUS_FILES)


def shipped_corpus(split: str) -> Path:
    """The GSM-style math corpus (`train`: 20,000 documents, `eval`: 1,000 held out), its
    first 2,000 and 200 as chat records (`chat-train`, `chat-eval`: `--targets chat`), and real
    prose, one document per chapter: the King James Bible (`kjv`: 1,189; docs/regime.md) and,
    for the regime experiment's GPU form, Austen's six novels and Moby-Dick (`novels`: 405)."""
    if split not in CORPUS_SPLITS:
        raise ValueError(f"shipped corpus split must be one of {CORPUS_SPLITS}, not {split!r}")
    return ASSETS / "corpus" / CORPUS_FILES[split]


def shipped_tokenizer_file(file_name: str) -> Path:
    """A tokenizer.json.zst from pipeline/assets/tokenizers (names are in tokenizers.toml)."""
    return ASSETS / "tokenizers" / file_name


def shipped_chat_template(file_name: str) -> Path:
    """A Jinja chat template from pipeline/assets/chat_templates (named in chat_templates.toml)."""
    return ASSETS / "chat_templates" / file_name
