"""A model folder's checkpoint against the model its config makes, before any weight is loaded.

transformers gives every weight a checkpoint lacks random values and only logs a report, and
AutoModelForCausalLM builds BERT-like encoders that attend to every token of their input. Either
way a model would score or train with no error. `check_causal_lm` builds the model on the meta
device (no memory) and refuses a config that makes no causal language model;
`check_checkpoint` then compares the checkpoint's tensor names (safetensors headers, a `.bin`'s
pickled index mapped to the meta device; no tensor is read) with the weights the model needs,
renamed the way transformers renames them when it loads (legacy names, fused experts, the base
model's prefix). Tied weights count as present when any weight of their group is (transformers
ties them either way round); buffers are computed from the config and never needed.

Checked where the checkpoint is a local folder in transformers' layout. Not checked: a GGUF file
(transformers maps its tensors to the model's while de-quantizing) and a hub id (its weights are
downloaded where it is loaded); their configs are still checked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.errors import VocagnoError
from pipeline.file_digests import damage_summary
from pipeline.log import get_logger
from pipeline.models.model_folder import PROVENANCE_NAME, model_folder_problems

# The files transformers loads from a folder, in its order of preference.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
NAMED = 3  # tensors a message names before "..."

log = get_logger("model")


class ModelError(VocagnoError):
    """A model's config or checkpoint cannot give the model it is used as."""


def check_model_config(path: Path) -> None:
    """ModelError for a config.json that is valid JSON but no model's (a stage-2 run's or
    checkpoint's settings, which transformers would reject in a traceback); a missing or
    unreadable one is left to the checks that name those problems."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(data, dict) and "model_type" not in data and "architectures" not in data:
        raise ModelError(
            f"{path} is not a model's configuration (no model_type or architectures): a "
            "stage-2 checkpoint or run folder? use the run's final/ folder, or a checkpoint "
            "exported by stage2_train/export.py"
        )


def check_causal_lm(config, what: str):
    """The model AutoModelForCausalLM builds from `config`, on the meta device; ModelError if
    that is no causal language model. `what` names the model in messages."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    model_type = f"model_type {config.model_type!r}"
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelError(
            f"{what} is not a causal language model: transformers has no causal-LM class for its "
            f"config ({model_type})"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Encoders (BERT, RoBERTa, ...) become decoders only when their config says is_decoder;
    # otherwise each position attends to the token it would be scored on.
    if getattr(model.config, "is_decoder", True) is False:
        raise ModelError(
            f"{what} is not a causal language model: its config ({model_type}, is_decoder "
            f"false) makes a {type(model).__name__} that attends to every token of its input, so "
            "each loss would see the token it scores"
        )
    return model


def checkpoint_tensor_names(folder: Path) -> set[str] | None:
    """Names of the tensors transformers would load from `folder`; None for no checkpoint in
    its layout (nothing to compare: the load itself reports it)."""
    chosen = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if chosen is None:
        return None
    if chosen.name.endswith(".index.json"):
        weight_map = json.loads(chosen.read_text(encoding="utf-8"))["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = [chosen]
    names: set[str] = set()
    for path in files:  # a shard the index lists but the folder lacks: its tensors are missing
        if path.is_file():
            names |= _tensor_names(path)
    return names


def _tensor_names(path: Path) -> set[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            return set(handle.keys())
    import pickle

    import torch

    try:  # the unpickler that builds only tensors, as transformers' own load of the file
        return set(torch.load(path, map_location="meta", weights_only=True, mmap=True))
    except pickle.UnpicklingError:
        raise ModelError(
            f"{path} holds objects other than tensors, which could run code when loaded: "
            "refusing it unloaded"
        ) from None


def check_checkpoint(model, folder: Path, what: str) -> None:
    """ModelError naming the first few of the weights `model` (check_causal_lm's) needs that the
    checkpoint in `folder` lacks; a warning naming the tensors it holds that the model does not
    use. A folder vocagno wrote is first checked against the digests its vocagno.json records:
    one damaged since it was saved is refused naming the file."""
    problems = model_folder_problems(folder)
    if problems:
        raise ModelError(f"cannot load {what}: the folder is damaged: {damage_summary(problems)}")
    if problems is None and (folder / PROVENANCE_NAME).exists():
        log.warning(f"{what}: its {PROVENANCE_NAME} records no digests: loaded unverified")
    try:
        names = checkpoint_tensor_names(folder)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot read the weights of {what}: {exc}") from exc
    if names is None:
        return
    state = model.state_dict()
    present = _as_model_names(model, names, state)
    # A tied weight (target -> source) is one weight: present if either name is.
    tied = model.all_tied_weights_keys
    needed = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(tied)
    missing = needed - present - {source for target, source in tied.items() if target in present}
    missing = _unignored(missing, model._keys_to_ignore_on_load_missing)
    if missing:
        raise ModelError(
            f"cannot load {what}: its checkpoint lacks {len(missing)} of the {len(needed)} "
            f"tensors the model needs ({_first(missing)}); transformers would fill them with "
            "random values. Give the folder its complete weights"
        )
    unused = _unignored(present - set(state), model._keys_to_ignore_on_load_unexpected)
    if unused:
        log.warning(
            f"{what}: its checkpoint holds {len(unused)} tensor(s) the model does not use, "
            f"ignored: {_first(unused)}"
        )


def _as_model_names(model, names: set[str], state: dict) -> set[str]:
    """Checkpoint names as the model's, renamed the way from_pretrained renames them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix
    renamed = set()
    for name in names:
        as_model, _ = rename_source_key(name, renamings, converters, prefix, state)
        if as_model not in state and name in state:  # a renaming that should not have applied
            as_model, _ = rename_source_key(name, [], [], prefix, state)
        renamed.add(as_model)
    return renamed


def _unignored(names: set[str], patterns) -> set[str]:
    """`names` less those the model's class tells transformers not to report."""
    if not patterns:
        return names
    ignored = re.compile("|".join(f"({p})" for p in patterns))
    return {name for name in names if not ignored.search(name)}


def _first(names: set[str]) -> str:
    listed = sorted(names)
    return ", ".join(listed[:NAMED]) + (", ..." if len(listed) > NAMED else "")


def check_causal_lm_weights(config, folder: Path | None, what: str) -> None:
    """check_causal_lm, then check_checkpoint where the model is a local folder (`folder`)."""
    model = check_causal_lm(config, what)
    if folder is not None:
        check_checkpoint(model, folder, what)
