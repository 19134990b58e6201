"""Load any tokenizer people use into one shape: token ids with character offsets, and a
fingerprint.

A spec is one of:
  - a shipped name (`tinyllama`, `mistral`, `qwen2.5`, `deepseek`, `smollm2`; see
    assets/tokenizers.toml),
  - a `tokenizer.json` file, plain or `.zst`,
  - a Hugging Face folder (its `tokenizer.json` and `tokenizer_config.json`),
  - a GGUF file (converted by transformers),
  - a hub id such as `TinyLlama/TinyLlama_v1.1` (where a hub is reachable).

Offsets are Python `str` indices into the text as given (the tokenizers library maps them back
through its normalizer, so NFC/NFKC and SentencePiece's space rewriting keep original positions).
BOS/EOS are added here, not by the tokenizer's post-processor, so every family is framed the same
way and the special tokens always carry the zero-width span (0, 0) or (len, len).

Three repairs make the offsets honest (docs/alignment.md shows the real spans behind each):
special-token strings inside the text ("<s>", "<|endoftext|>") are tokenized as plain text, so a
document that mentions "</s>" gets no EOS in its middle; SentencePiece's lone dummy prefix and
characters a normalizer drops are repaired by pipeline.token_offsets.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pipeline.errors import TokenizerError
from pipeline.hub import is_hub_id
from pipeline.io import fingerprint, read_bytes
from pipeline.shipped import ASSETS, shipped_tokenizer_file
from pipeline.token_offsets import (
    Encoding,
    Encodings,
    cover_dropped_characters,
    framed,
    zero_dummy_prefix,
)

# What a tokenizer spec may be, for --help texts.
TOKENIZER_SPEC = (
    "shipped name (tinyllama, mistral, qwen2.5, deepseek, smollm2), tokenizer.json[.zst], "
    "Hugging Face folder, .gguf file or hub id"
)
# Files by which a model folder carries its own tokenizer (fast, a declared class, SentencePiece,
# BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Bump when the offset repairs (pipeline.token_offsets) change: offsets from an older rule set are
# different data.
OFFSET_RULES = 1


@dataclass(frozen=True)
class FramingPolicy:
    """How a model family frames a document: an optional BOS before it, an EOS after it."""

    add_bos: bool
    bos_token: str | None
    eos_token: str | None


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the framing policy and identity the pipeline needs."""

    def __init__(self, backend: Tokenizer, policy: FramingPolicy, spec: str):
        self.backend = backend
        self.policy = policy
        self.spec = spec
        self.bos_id = self._special_id(policy.bos_token) if policy.add_bos else None
        self.eos_id = self._special_id(policy.eos_token) if policy.eos_token else None
        # A tokenizer.json may carry truncation/padding settings; documents must come back whole.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = True
        prefix = _dummy_prefix(_component(backend.normalizer), _component(backend.pre_tokenizer))
        self.dummy_prefix_id = backend.token_to_id(prefix) if prefix else None
        # Offsets are the whole point; a tokenizer that cannot give them is useless here.
        probe = backend.encode("ab", add_special_tokens=False)
        if probe.ids and not any(end > start for start, end in probe.offsets):
            raise TokenizerError(f"tokenizer {spec!r} gives no character offsets")

    def _special_id(self, token: str | None) -> int | None:
        token_id = self.backend.token_to_id(token) if token else None
        if token and token_id is None:
            raise TokenizerError(
                f"tokenizer {self.spec!r} has no token {token!r} named in its policy"
            )
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of the canonical tokenizer JSON and the framing policy: what a cache records."""
        return fingerprint(
            {
                "tokenizer": json.loads(self.backend.to_str()),
                "add_bos": self.policy.add_bos,
                "bos": self.policy.bos_token,
                "eos": self.policy.eos_token,
                "special_tokens_in_text": "as_text",
                "offset_rules": OFFSET_RULES,
            }
        )

    def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool = False) -> Encoding:
        return self.encode_batch([text], add_bos=add_bos, add_eos=add_eos)[0]

    def encode_batch(
        self, texts: list[str], *, add_bos: bool | None = None, add_eos: bool = False
    ) -> list[Encoding]:
        """Tokenize with offsets, one Encoding per text. `add_bos=None` follows the family's
        policy."""
        return self.encode_concatenated(texts, add_bos=add_bos, add_eos=add_eos).split()

    def encode_concatenated(
        self, texts: list[str], *, add_bos: bool | None = None, add_eos: bool = False
    ) -> Encodings:
        """Tokenize with offsets, the documents' tokens concatenated (what a reader of many
        documents wants: no per-document arrays, the repairs and the framing done once for the
        batch)."""
        use_bos = self.policy.add_bos if add_bos is None else add_bos
        if use_bos and self.bos_id is None:
            raise TokenizerError(f"tokenizer {self.spec!r} has no BOS token")
        if add_eos and self.eos_id is None:
            raise TokenizerError(f"tokenizer {self.spec!r} has no EOS token")
        encoded = self.backend.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        text_lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        chain = itertools.chain.from_iterable
        ids = np.fromiter(chain(e.ids for e in encoded), dtype=np.int32, count=int(lengths.sum()))
        offsets = np.fromiter(
            chain(chain(e.offsets for e in encoded)), dtype=np.int32, count=2 * ids.size
        ).reshape(-1, 2)
        start, end = offsets[:, 0].copy(), offsets[:, 1].copy()
        document = np.repeat(np.arange(len(texts)), lengths)
        if self.dummy_prefix_id is not None:
            zero_dummy_prefix(ids, start, end, document, self.dummy_prefix_id)
        cover_dropped_characters(start, end, document, text_lengths)
        return framed(
            Encodings(ids, start, end, lengths),
            text_lengths,
            self.bos_id if use_bos else None,
            self.eos_id if add_eos else None,
        )

    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"TextTokenizer({self.spec!r}, vocab={self.vocab_size}, policy={self.policy})"


def _component(component) -> dict:
    """The JSON config of a normalizer / pre-tokenizer / post-processor (empty if there is none)."""
    return json.loads(component.__getstate__()) if component is not None else {}


def _dummy_prefix(normalizer: dict, pre_tokenizer: dict) -> str | None:
    """The character a SentencePiece-style tokenizer prepends to the text, if it does."""

    def parts(component: dict, key: str) -> list[dict]:
        return component.get(key, []) if component.get("type") == "Sequence" else [component]

    for norm in parts(normalizer, "normalizers"):
        if norm.get("type") == "Prepend":
            return norm["prepend"]
    for pre in parts(pre_tokenizer, "pretokenizers"):
        if pre.get("type") == "Metaspace":
            scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space") else "never")
            if scheme != "never":
                return pre["replacement"]
    return None


@functools.cache
def shipped_tokenizers() -> dict[str, dict]:
    """Name -> provenance record of the tokenizers that ship inside the package."""
    return tomllib.loads((ASSETS / "tokenizers.toml").read_text(encoding="utf-8"))


def _policy_from_template(backend: Tokenizer) -> FramingPolicy:
    """Read BOS from a TemplateProcessing post-processor, the only place a bare file records it."""
    post = _component(backend.post_processor)
    processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for proc in processors:
        if proc.get("type") == "TemplateProcessing":
            first = (proc.get("single") or [{}])[0]
            if "SpecialToken" in first:
                return FramingPolicy(True, first["SpecialToken"]["id"], None)
    return FramingPolicy(False, None, None)


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _policy_from_config(config: dict, fallback: FramingPolicy) -> FramingPolicy:
    bos = _token_text(config.get("bos_token")) or fallback.bos_token
    eos = _token_text(config.get("eos_token")) or fallback.eos_token
    add_bos = config.get("add_bos_token", fallback.add_bos)
    return FramingPolicy(bool(add_bos and bos), bos if add_bos else None, eos)


def _from_tokenizer_json(path: Path, config: dict | None, spec: str) -> TextTokenizer:
    try:
        backend = Tokenizer.from_str(read_bytes(path).decode("utf-8"))
    except Exception as exc:  # the tokenizers library raises bare Exceptions on bad JSON
        raise TokenizerError(f"cannot read tokenizer file {path}: {exc}") from exc
    policy = _policy_from_template(backend)
    if config is not None:
        policy = _policy_from_config(config, policy)
    return TextTokenizer(backend, policy, spec)


def _from_transformers(spec: str, source: str, **kwargs) -> TextTokenizer:
    """Hub ids, GGUF files and folders without a tokenizer.json go through AutoTokenizer."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as exc:
        raise TokenizerError(f"cannot load tokenizer {spec!r}: {exc}") from exc
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(
            f"tokenizer {spec!r} is a slow (Python) tokenizer; it gives no character offsets"
        )
    add_bos = bool(getattr(hf, "add_bos_token", False) and hf.bos_token)
    return TextTokenizer(
        backend, FramingPolicy(add_bos, hf.bos_token if add_bos else None, hf.eos_token), spec
    )


def _from_gguf(path: Path) -> TextTokenizer:
    """transformers converts the vocabulary but ignores the file's BOS flag; read it ourselves."""
    import gguf

    if not path.exists():
        raise TokenizerError(f"GGUF file {path} does not exist")
    try:
        fields = gguf.GGUFReader(path).fields
    except Exception as exc:  # gguf raises ValueError/struct errors on a damaged header
        raise TokenizerError(f"cannot read GGUF file {path}: {exc}") from exc

    def value(key: str, default=None):
        return fields[key].contents() if key in fields else default

    loaded = _from_transformers(str(path), str(path.parent), gguf_file=path.name)
    # llama.cpp's defaults when the flag is absent: SentencePiece ("llama") vocabularies add BOS.
    add_bos = value("tokenizer.ggml.add_bos_token", value("tokenizer.ggml.model") == "llama")
    bos_id, eos_id = value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id")
    token = loaded.backend.id_to_token
    bos = token(bos_id) if bos_id is not None else None
    eos = token(eos_id) if eos_id is not None else loaded.policy.eos_token
    policy = FramingPolicy(bool(add_bos and bos), bos if add_bos else None, eos)
    return TextTokenizer(loaded.backend, policy, str(path))


def _read_config(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc


def has_tokenizer_files(folder: Path) -> bool:
    """Whether a model folder carries its own tokenizer (a GGUF file embeds one)."""
    return any((folder / name).exists() for name in TOKENIZER_FILES) or any(folder.glob("*.gguf"))


@functools.lru_cache(maxsize=16)
def load_tokenizer(spec: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer from any supported spec (see the module docstring)."""
    spec = str(spec)
    shipped = shipped_tokenizers()
    if spec in shipped:
        record = shipped[spec]
        path = shipped_tokenizer_file(record["file"])
        backend = Tokenizer.from_str(read_bytes(path).decode("utf-8"))
        policy = FramingPolicy(record["add_bos"], record.get("bos"), record.get("eos"))
        return TextTokenizer(backend, policy, spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        config = _read_config(path / "tokenizer_config.json")
        if (path / "tokenizer.json").exists():
            return _from_tokenizer_json(path / "tokenizer.json", config, spec)
        return _from_transformers(spec, str(path))
    if path.suffix == ".gguf":
        return _from_gguf(path)
    if path.name.endswith((".json", ".json.zst")):
        if not path.exists():
            raise TokenizerError(f"tokenizer file {path} does not exist")
        return _from_tokenizer_json(path, None, spec)
    if path.exists():
        raise TokenizerError(f"{path} is not a tokenizer.json, a GGUF file or a model folder")
    if not is_hub_id(spec):
        raise TokenizerError(
            f"no tokenizer at {spec!r}: not a file or folder, and not a shipped name "
            f"({', '.join(sorted(shipped))})"
        )
    return _from_transformers(spec, spec)
