"""Export a stage-2 checkpoint as a model folder:
`python stage2_train/export.py OUT/checkpoints/step-N --out DIR [--overwrite]`.

The folder is written as OUT/final is: the student's weights by save_pretrained (safetensors), its
tokenizer, and vocagno.json saying what produced it, so that `vocagno eval` (or transformers) reads
a run's intermediate steps, which a curve over the token budget needs. Only the model's part of
the checkpoint is read, not the optimizer's.

Export writes only where it may: a new or empty --out, or (with --overwrite) an earlier export
holding only what an export wrote (the files its vocagno.json records), which it replaces. A
folder holding a stage-2 run, a checkpoint (its own source included), a cache, a model it did not
export or anyone's files is refused in one line, --overwrite or not, and so is an earlier export
beside files of yours, and a folder inside the checkpoint's run (which would then hold files
stage 2 did not write)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.errors import ConfigError, exit_code  # noqa: E402
from pipeline.log import configure, get_logger  # noqa: E402

EARLIER_EXPORT = "an earlier export"


def verify_checkpoint(checkpoint: Path) -> None:
    """CacheError naming the first damaged file; a checkpoint from before digests, a warning."""
    import warnings

    from pipeline.errors import CacheError
    from pipeline.file_digests import damage_summary, share_problems
    from stage2_train.checkpoint_digests import recorded_digests

    recorded = recorded_digests(checkpoint)
    if recorded is None:
        warnings.warn(f"checkpoint {checkpoint} records no digests: exported unverified",
                      stacklevel=2)  # fmt: skip
        return
    problems = share_problems(checkpoint, recorded, 0, 1)
    if problems:
        raise CacheError(f"checkpoint {checkpoint} is damaged: {damage_summary(problems)}")


def _holds(folder: Path) -> str:
    """What a non-empty folder holds, as the refusal names it."""
    from pipeline.cache.manifest import MANIFEST_NAME
    from pipeline.metrics import METRICS_NAME
    from pipeline.models.model_folder import PROVENANCE_NAME
    from stage2_train.checkpoint import CHECKPOINTS, MARKER
    from stage2_train.output import RUN_CONFIG, is_run_config

    names = {entry.name for entry in folder.iterdir()}
    if MARKER in names:
        return "a stage-2 checkpoint"
    if {CHECKPOINTS, METRICS_NAME} & names or is_run_config(folder / RUN_CONFIG):
        return "a stage-2 run"
    if MANIFEST_NAME in names or any(name.endswith(".parquet") for name in names):
        return "a teacher-loss cache"
    if PROVENANCE_NAME in names:
        try:
            provenance = json.loads((folder / PROVENANCE_NAME).read_text())
        except (OSError, ValueError):
            provenance = None
        if isinstance(provenance, dict) and "exported_from" in provenance:
            return EARLIER_EXPORT
        return "a model stage 2 wrote (a run's final/)"
    if RUN_CONFIG in names:
        return "a model"
    return f"files export did not write ({_listed(sorted(names))})"


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _not_exported(folder: Path) -> list[str]:
    """What an earlier export's folder holds beyond the files its vocagno.json records (all of it
    where that records none: an export from before digests, or a damaged record)."""
    import os

    from pipeline.errors import CacheError
    from pipeline.file_digests import parse_record, recorded_files
    from pipeline.models.model_folder import PROVENANCE_NAME

    try:
        path = folder / PROVENANCE_NAME
        written = {PROVENANCE_NAME, *recorded_files(parse_record(path), path)}
    except CacheError:
        written = set()
    # the folders that hold a written file are the export's too
    written |= {str(parent) for name in written for parent in Path(name).parents} - {"."}
    present = [
        os.path.relpath(os.path.join(root, name), folder)
        for root, folders, files in os.walk(folder)
        for name in folders + files
    ]
    return sorted(name for name in present if name not in written)


def export_refusal(checkpoint: Path, dest: Path, overwrite: bool) -> str | None:
    """Why `dest` may not receive `checkpoint`'s export, or None."""
    from stage2_train.checkpoint import CHECKPOINTS

    source, target = checkpoint.resolve(), dest.expanduser().resolve()
    if target == source or target in source.parents:
        holds = "is" if target == source else "holds"
        return f"--out {dest} {holds} the checkpoint being exported; choose another folder"
    run = source.parents[1] if source.parent.name == CHECKPOINTS else None
    if run is not None and run in target.parents:
        return (
            f"--out {dest} is inside the stage-2 run {run}, which would then hold files stage 2 "
            "did not write; choose a folder outside it"
        )
    if target.is_file():
        return f"--out {dest} is a file; give a folder for the model"
    if not target.is_dir() or not any(target.iterdir()):
        return None
    holds = _holds(target)
    if holds == EARLIER_EXPORT:
        if not overwrite:
            return (
                f"--out {dest} holds an earlier export; choose another folder, or pass --overwrite"
            )
        others = _not_exported(target)
        if others:
            return (
                f"--out {dest} holds an earlier export and files it did not write "
                f"({_listed(others)}): --overwrite replaces only what an export wrote; move them, "
                "or choose another folder"
            )
        return None
    return (
        f"--out {dest} holds {holds}, not an earlier export: export never replaces it, "
        "--overwrite or not; choose a new or empty folder"
    )


def export_checkpoint(checkpoint: Path, dest: Path, *, overwrite: bool = False) -> Path:
    """Write `checkpoint`'s student to `dest` (published whole, or not at all); ConfigError on a
    folder that is no complete checkpoint, or on a `dest` it may not write (`export_refusal`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from pipeline.models.model_folder import write_model_folder
    from pipeline.models.student import build_student, student_tokenizer_spec
    from pipeline.tokenizer import load_tokenizer
    from pipeline.versions import software_versions
    from stage2_train.checkpoint import MARKER, single_process_is_intended
    from stage2_train.checkpoint_reader import load_state

    checkpoint, dest = Path(checkpoint), Path(dest)
    if not (checkpoint / MARKER).is_file():
        raise ConfigError(
            f"{checkpoint} is no complete stage-2 checkpoint (no {MARKER} file): give a folder "
            "OUT/checkpoints/step-N that a run finished writing"
        )
    refusal = export_refusal(checkpoint, dest, overwrite)
    if refusal:
        raise ConfigError(refusal)
    verify_checkpoint(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    saved = json.loads((checkpoint / "checkpoint.json").read_text())
    tokenizer = load_tokenizer(
        student_tokenizer_spec(config["student"], config.get("student_tokenizer"))
    )
    student = build_student(config["student"], tokenizer, config["seed"], config["seq_len"])
    # the trainer saved get_state_dict's names, which leave out compile and DDP/FSDP wrappers
    state = {"model": get_model_state_dict(student)}
    with single_process_is_intended():
        load_state(state, checkpoint / "state", no_dist=True)
    set_model_state_dict(student, state["model"])
    provenance = {
        "config": config,
        **saved,
        "exported_from": str(checkpoint.resolve()),
        "software": software_versions(),
    }
    return write_model_folder(dest, student, tokenizer, provenance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        usage="python stage2_train/export.py CHECKPOINT --out DIR [--overwrite]",
    )
    parser.add_argument("checkpoint", type=Path, help="a complete OUT/checkpoints/step-N folder")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export at --out (only that)"
    )
    args = parser.parse_args(argv)
    configure()

    def export() -> None:
        dest = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
        get_logger("export").info(f"wrote {dest} from {args.checkpoint}")

    return exit_code("stage2_train/export.py", export)


if __name__ == "__main__":
    sys.exit(main())
