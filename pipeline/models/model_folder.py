"""A trained model as a folder transformers and `vocagno eval` read: its weights by save_pretrained
(safetensors), its tokenizer, and vocagno.json saying what produced it and recording every other
file's size and digest (pipeline.file_digests), checked before the folder is loaded again. Stage 2
writes OUT/final so, and stage2_train/export.py a checkpoint."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import CacheError
from pipeline.file_digests import (
    DIGEST,
    digest_share,
    folder_files,
    parse_record,
    recorded_files,
    share_problems,
)
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
        files = digest_share(partial, folder_files(partial, leave_out=PROVENANCE_NAME), 0, 1)
        atomic_write_json(partial / PROVENANCE_NAME, {**provenance, "digest": DIGEST, "files": files})
    return dest


def model_folder_problems(folder: Path) -> list[str] | None:
    """What is wrong with the files a model folder's vocagno.json records (empty: whole); None
    where there is no vocagno.json, or one from before digests (it lists no files). A vocagno.json
    that does not parse or lists its files wrongly is damage, said as the first problem."""
    path = folder / PROVENANCE_NAME
    if not path.exists():
        return None
    try:
        provenance = parse_record(path)
        if isinstance(provenance, dict) and not {"files", "digest"} & provenance.keys():
            return None
        files = recorded_files(provenance, path)
    except CacheError as exc:
        return [str(exc)]
    return share_problems(folder, files, 0, 1)
