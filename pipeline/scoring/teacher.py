"""Where a teacher comes from, what identifies it, and loading it (config, tokenizer, weights).

A teacher spec is a local Hugging Face folder, a `.gguf` file, or a hub id (`owner/name`, with an
optional revision; only where a hub is reachable). Its identity, recorded in every cache, is the
sha256 of every file of a folder (weights, config and tokenizer), of the GGUF file, or the
resolved commit of a hub id: a changed teacher can never mix into an existing cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.choices import TORCH_DTYPES
from pipeline.errors import TokenizerError, VocagnoError
from pipeline.hub import is_hub_id
from pipeline.io import sha256_file, sha256_text
from pipeline.models.checkpoint import check_causal_lm_weights, check_model_config
from pipeline.tokenizer import (
    TOKENIZER_FILES,
    TOKENIZER_SPEC,
    TextTokenizer,
    has_tokenizer_files,
    load_tokenizer,
)

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class TeacherError(VocagnoError):
    """The teacher cannot be found, read or loaded, or does not fit its tokenizer."""


@dataclass(frozen=True)
class TeacherSource:
    spec: str
    kind: Literal["folder", "gguf", "hub"]
    path: Path | None = None
    revision: str | None = None
    role: str = "teacher"  # what messages call it: `vocagno eval` measures any model

    @property
    def load_args(self) -> tuple[str, dict]:
        """(name_or_path, kwargs) for transformers' from_pretrained."""
        if self.kind == "gguf":
            return str(self.path.parent), {"gguf_file": self.path.name}
        if self.kind == "hub":
            return self.spec, {"revision": self.revision} if self.revision else {}
        return str(self.path), {}


def resolve_teacher(spec: str, revision: str | None = None, role: str = "teacher") -> TeacherSource:
    path = Path(spec).expanduser()
    if path.is_dir():
        check_model_config(path / "config.json")
        if not (path / "config.json").exists() and not list(path.glob("*.gguf")):
            raise TeacherError(f"{role} folder {path} has no config.json: not a model folder")
        return TeacherSource(spec, "folder", path.resolve(), role=role)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TeacherError(f"{role} GGUF file {path} does not exist")
        return TeacherSource(spec, "gguf", path.resolve(), role=role)
    if path.exists():
        raise TeacherError(f"{role} {path} is neither a model folder nor a .gguf file")
    if not is_hub_id(spec):
        raise TeacherError(f"{role} {spec!r} does not exist (and is not a hub id owner/name)")
    return TeacherSource(spec, "hub", None, revision, role)


def _folder_digest(folder: Path) -> str:
    """One hash over every (relative name, sha256) in the folder; hidden files are bookkeeping."""
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not p.relative_to(folder).as_posix().startswith(".")
    )
    lines = "".join(f"{p.relative_to(folder).as_posix()}\t{sha256_file(p)}\n" for p in files)
    return sha256_text(lines)


def teacher_identity(source: TeacherSource) -> dict:
    """What a cache records about its teacher (see the module docstring)."""
    if source.kind == "folder":
        return {
            "kind": "folder",
            "name": source.path.name,
            "content_sha256": _folder_digest(source.path),
        }
    if source.kind == "gguf":
        return {
            "kind": "gguf",
            "name": source.path.name,
            "content_sha256": sha256_file(source.path),
        }
    try:
        from huggingface_hub import HfApi

        commit = HfApi().model_info(source.spec, revision=source.revision).sha
    except Exception as exc:
        raise TeacherError(f"cannot resolve hub {source.role} {source.spec!r}: {exc}") from exc
    return {"kind": "hub", "name": source.spec, "revision": commit}


def check_weights_readable(source: TeacherSource) -> None:
    """Fail in the driver, before any worker starts, on missing or unreadable weight files.

    Reads only headers (safetensors index, GGUF metadata), not the weights themselves.
    """
    if source.kind == "hub":
        return
    if source.kind == "gguf":
        files = [source.path]
    else:
        files = sorted(p for pattern in WEIGHT_PATTERNS for p in source.path.glob(pattern))
        if not files:
            raise TeacherError(
                f"{source.role} folder {source.path} holds no weights ({', '.join(WEIGHT_PATTERNS)})"
            )
    for path in files:
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt"):
                    pass
            elif path.suffix == ".gguf":
                from gguf import GGUFReader

                GGUFReader(str(path))
        except Exception as exc:
            raise TeacherError(f"{source.role} weights {path} are unreadable: {exc}") from exc


def check_model_weights(source: TeacherSource, config) -> None:
    """Refuse, before any weight is loaded, a config that makes no causal language model, and a
    local folder whose checkpoint lacks weights the model needs (pipeline.models.checkpoint)."""
    folder = source.path if source.kind == "folder" else None
    check_causal_lm_weights(config, folder, f"{source.role} {source.spec!r}")


def load_teacher_config(source: TeacherSource):
    from transformers import AutoConfig

    name, kwargs = source.load_args
    try:
        return AutoConfig.from_pretrained(name, **kwargs)
    except Exception as exc:
        raise TeacherError(
            f"cannot read the config of {source.role} {source.spec!r}: {exc}"
        ) from exc


def teacher_context_length(config) -> int | None:
    """The longest sequence the teacher was built for, if its config says."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _CONTEXT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


# Models pad their embedding table past the tokenizer (Qwen2.5: 151,643 of 151,936; Phi-2: 50,295
# of 51,200); a tokenizer below this share of the table belongs to another model.
MIN_VOCABULARY_SHARE = 0.95


def load_teacher_tokenizer(source: TeacherSource, override: str | None = None) -> TextTokenizer:
    """The teacher's own tokenizer (or `override`), which must give character offsets."""
    spec = override or (str(source.path) if source.kind == "gguf" else source.load_args[0])
    if override is None and source.kind == "folder" and not has_tokenizer_files(source.path):
        raise TokenizerError(
            f"{source.role} folder {source.path} holds no tokenizer (no "
            f"{' or '.join(TOKENIZER_FILES)}): pass --tokenizer with the {source.role}'s tokenizer "
            f"({TOKENIZER_SPEC})"
        )
    try:
        return load_tokenizer(spec)
    except TokenizerError as exc:
        raise TokenizerError(f"{source.role} {source.spec!r}: {exc}") from exc


def check_tokenizer_fits(
    tokenizer: TextTokenizer, config, source: TeacherSource, force: bool = False
) -> None:
    """The tokenizer must belong to the model. Ids beyond the embedding table would index garbage
    or crash: always refused. A vocabulary far smaller than the model's (beyond the padding
    models add), or a --tokenizer other than the one the teacher's folder carries, gives losses of
    a tokenization the teacher never saw: refused unless `force`."""
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    largest = max(tokenizer.vocab().values())
    if vocab is not None and largest >= vocab:
        raise TeacherError(
            f"tokenizer {tokenizer.spec!r} has token ids up to {largest}, but the teacher's "
            f"vocabulary has {vocab} entries: they do not belong together"
        )
    if force:
        return
    if vocab is not None and tokenizer.vocab_size < MIN_VOCABULARY_SHARE * vocab:
        raise TeacherError(
            f"tokenizer {tokenizer.spec!r} has {tokenizer.vocab_size} tokens, the teacher's "
            f"vocabulary {vocab}: they do not look like one model's; pass --force-tokenizer if "
            "they are"
        )
    own = _own_tokenizer(source)
    if own is not None and own.fingerprint != tokenizer.fingerprint:
        raise TeacherError(
            f"--tokenizer {tokenizer.spec!r} is not the tokenizer in the teacher's folder "
            f"({own.vocab_size} tokens there, {tokenizer.vocab_size} here): the losses would be of a "
            "tokenization the teacher was not trained on; drop --tokenizer, or pass "
            "--force-tokenizer if this is intended"
        )


def _own_tokenizer(source: TeacherSource) -> TextTokenizer | None:
    """The tokenizer the teacher's folder or GGUF file carries, if it has a usable one."""
    if source.kind == "hub" or (source.kind == "folder" and not has_tokenizer_files(source.path)):
        return None
    try:
        return load_teacher_tokenizer(source)
    except TokenizerError:
        return None


def load_teacher_model(source: TeacherSource, dtype: str, device: str):
    """The causal LM in eval mode on `device`; `dtype="checkpoint"` keeps the checkpoint's."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in TORCH_DTYPES:
        raise TeacherError(f"dtype must be one of {TORCH_DTYPES}, not {dtype!r}")
    name, kwargs = source.load_args
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype="auto" if dtype == "checkpoint" else getattr(torch, dtype), **kwargs
        )
    except Exception as exc:
        raise TeacherError(f"cannot load {source.role} {source.spec!r}: {exc}") from exc
    return model.to(device).eval()


def describe_config(config) -> dict:
    """The architecture facts worth keeping beside a cache (not its identity: that is the hash)."""
    data = json.loads(config.to_json_string(use_diff=False))
    keep = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers")
    return {k: data[k] for k in keep if k in data}
