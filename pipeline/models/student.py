"""Build or load the student (a preset, a config, a folder or a hub id). Wrapping it for data
parallelism is stage 2's (`stage2_train/parallel.py`), saving its tokenizer `hf_tokenizer.py`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pipeline.errors import ConfigError
from pipeline.hub import is_hub_id
from pipeline.models.checkpoint import WEIGHT_FILES, check_causal_lm_weights, check_model_config
from pipeline.models.presets import PRESETS
from pipeline.tokenizer import TextTokenizer


def student_kind(spec: str) -> str:
    """preset | config (config.json, or a folder without weights) | pretrained (folder, hub id)."""
    if spec in PRESETS:
        return "preset"
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        check_model_config(path)
        return "config"
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"student folder {path} has no config.json")
        check_model_config(path / "config.json")
        return "pretrained" if any((path / f).exists() for f in WEIGHT_FILES) else "config"
    if path.exists() or not is_hub_id(spec):
        raise ConfigError(
            f"student {spec!r} is not a preset ({', '.join(PRESETS)}), a config.json, a model "
            "folder or a hub id"
        )
    return "pretrained"


def student_tokenizer_spec(student: str, tokenizer: str | None) -> str:
    if tokenizer:
        return tokenizer
    if student_kind(student) != "pretrained":
        raise ConfigError(
            f"student {student!r} is trained from scratch and brings no tokenizer: "
            "pass --student-tokenizer"
        )
    return student


def build_student(spec: str, tokenizer: TextTokenizer, seed: int, seq_len: int) -> nn.Module:
    """The student as a float32 transformers causal LM; from scratch it is seeded by `seed`."""
    from transformers import AutoModelForCausalLM

    if student_kind(spec) == "pretrained":
        model = _pretrained(spec)
    else:
        config = student_config(spec, tokenizer, seq_len)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(
            f"student tokenizer {tokenizer.spec!r} has {tokenizer.vocab_size} tokens but the "
            f"student's embedding only {model.config.vocab_size}"
        )
    return model


def student_config(spec: str, tokenizer: TextTokenizer, seq_len: int):
    """The student's transformers config, without its weights: a preset's (its vocabulary the
    tokenizer's), or the config.json of a file, folder or hub id."""
    from transformers import AutoConfig, LlamaConfig

    if student_kind(spec) == "preset":
        return LlamaConfig(
            vocab_size=tokenizer.vocab_size,
            max_position_embeddings=max(2048, seq_len),
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
            **PRESETS[spec],
        )
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot read the config of student {spec!r}: {first}") from None


def load_trained_student(spec: str) -> nn.Module:
    """A trained student (a model folder or hub id) to measure, in eval mode: loaded as stage 2
    loads one, its folder checked first (config, digests, weights against the model)."""
    if student_kind(spec) != "pretrained":
        raise ConfigError(
            f"student {spec!r} has no weights: give a trained model (a run's final/, an export "
            "or a hub id)"
        )
    return _pretrained(spec).eval()


def _pretrained(spec: str) -> nn.Module:
    """The one load of a student with weights: a local folder's config and checkpoint are checked
    (pipeline.models.checkpoint) before transformers reads any weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(spec).expanduser()
    if folder.is_dir():  # a hub id's weights are downloaded by from_pretrained itself
        try:
            config = AutoConfig.from_pretrained(folder)
        except Exception as exc:  # transformers raises ValueError, KeyError, OSError, ...
            raise ConfigError(f"cannot read the config of student {spec!r}: {exc}") from None
        check_causal_lm_weights(config, folder, f"student {spec!r}")
    try:
        return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)
    except OSError as exc:
        raise ConfigError(f"cannot load student {spec!r}: {exc}") from exc
