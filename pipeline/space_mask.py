"""The space mask of a tokenizer: the tokens after which a word boundary is certain, for the
teacher's space log-probability (`--space-logprob`, docs/cache-columns.md).

S holds every token whose string begins with a space, newline or tab marker, plus every special
token (tokenkit's `space_mask_mode = space+tab+newline+special`). The markers depend on how the
vocabulary writes a leading blank:
  - byte-level BPE (GPT-2, Qwen, SmolLM2): `Ġ` (space), `Ċ` (newline), `ĉ` (tab);
  - SentencePiece (Llama, Mistral): `▁` (space), and the byte-fallback pieces `<0x20>`, `<0x0A>`,
    `<0x09>` (SentencePiece has no newline or tab piece of its own).
A raw space, newline or tab as first character counts in both. The scheme is the one whose space
marker begins more tokens. The mask is built once per tokenizer from its vocabulary with vectorized
string tests, padded with False up to the teacher's head size (ids the tokenizer never produces),
and described by `space_mask_identity`, which a cache records.
"""

from __future__ import annotations

import hashlib

import numpy as np

MODE = "space+tab+newline+special"
MARKERS = {
    "byte-level": ("Ġ", "Ċ", "ĉ", " ", "\n", "\t"),
    "sentencepiece": ("▁", "<0x20>", "<0x0A>", "<0x09>", " ", "\n", "\t"),
}


def _strings(tokenizer) -> np.ndarray:
    """Token strings indexed by id ('' where an id has none)."""
    vocab = tokenizer.vocab()
    strings = np.full(max(vocab.values(), default=-1) + 1, "", dtype=object)
    strings[np.fromiter(vocab.values(), dtype=np.int64)] = list(vocab.keys())
    return strings.astype(str)


def space_scheme(strings: np.ndarray) -> str:
    byte_level = np.char.startswith(strings, "Ġ").sum()
    sentencepiece = np.char.startswith(strings, "▁").sum()
    return "byte-level" if byte_level >= sentencepiece else "sentencepiece"


def space_mask(tokenizer, size: int | None = None) -> tuple[np.ndarray, dict]:
    """(bool mask over ids 0..size-1, its identity) for a pipeline.tokenizer.TextTokenizer."""
    strings = _strings(tokenizer)
    size = len(strings) if size is None else size
    if size < len(strings):
        raise ValueError(
            f"a head of {size} outputs is smaller than the vocabulary ({len(strings)})"
        )
    scheme = space_scheme(strings)
    mask = np.zeros(size, dtype=bool)
    for marker in MARKERS[scheme]:
        mask[: len(strings)] |= np.char.startswith(strings, marker)
    special = [
        i for i, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special
    ]
    special = np.asarray([i for i in special if i < size], dtype=np.int64)
    mask[special] = True
    return mask, space_mask_identity(mask, scheme, int(special.size))


def space_mask_identity(mask: np.ndarray, scheme: str, special: int) -> dict:
    """What a cache records of the mask: how it was built, its size, and a hash of its bits."""
    return {
        "mode": MODE,
        "scheme": scheme,
        "markers": list(MARKERS[scheme]),
        "special_tokens": special,
        "tokens": int(mask.sum()),
        "size": int(mask.size),
        "sha256": hashlib.sha256(np.packbits(mask).tobytes()).hexdigest(),
    }
