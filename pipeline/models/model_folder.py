"""A trained model as a folder transformers and `vocagno eval` read: its weights by save_pretrained
(safetensors), its tokenizer, and vocagno.json saying what produced it. Stage 2 writes OUT/final
so, and stage2_train/export.py a checkpoint."""

from __future__ import annotations

from pathlib import Path

from pipeline.io import atomic_write_json, staged_folder
from pipeline.models.hf_tokenizer import save_tokenizer

PROVENANCE_NAME = "vocagno.json"


def write_model_folder(
    dest: Path, model, tokenizer, provenance: dict, state_dict: dict | None = None
) -> Path:
    """`model` (a transformers model; `state_dict` its weights if not its own) with `tokenizer`
    and `provenance` into `dest`, published whole or not at all."""
    with staged_folder(dest) as partial:
        model.save_pretrained(partial, state_dict=state_dict, safe_serialization=True)
        save_tokenizer(tokenizer, partial)
        atomic_write_json(partial / PROVENANCE_NAME, provenance)
    return dest
