"""Export a stage-2 checkpoint as a model folder:
`python stage2_train/export.py OUT/checkpoints/step-N --out DIR [--overwrite]`.

The folder is written as OUT/final is: the student's weights by save_pretrained (safetensors), its
tokenizer, and vocagno.json saying what produced it, so that `vocagno eval` (or transformers) reads
a run's intermediate steps, which a curve over the token budget needs. Only the model's part of
the checkpoint is read, not the optimizer's."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.errors import ConfigError, exit_code  # noqa: E402
from pipeline.log import configure, get_logger  # noqa: E402


def export_checkpoint(checkpoint: Path, dest: Path, *, overwrite: bool = False) -> Path:
    """Write `checkpoint`'s student to `dest` (published whole, or not at all); ConfigError on a
    folder that is no complete checkpoint, or on an existing `dest` unless `overwrite`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from pipeline.models.model_folder import write_model_folder
    from pipeline.models.student import build_student, student_tokenizer_spec
    from pipeline.tokenizer import load_tokenizer
    from pipeline.versions import software_versions
    from stage2_train.checkpoint import MARKER, single_process_is_intended

    checkpoint, dest = Path(checkpoint), Path(dest)
    if not (checkpoint / MARKER).is_file():
        raise ConfigError(
            f"{checkpoint} is no complete stage-2 checkpoint (no {MARKER} file): give a folder "
            "OUT/checkpoints/step-N that a run finished writing"
        )
    if dest.exists() and not overwrite:
        raise ConfigError(f"{dest} exists; choose another folder, or pass --overwrite")
    config = json.loads((checkpoint / "config.json").read_text())
    saved = json.loads((checkpoint / "checkpoint.json").read_text())
    tokenizer = load_tokenizer(
        student_tokenizer_spec(config["student"], config.get("student_tokenizer"))
    )
    student = build_student(config["student"], tokenizer, config["seed"], config["seq_len"])
    # the trainer saved get_state_dict's names, which leave out compile and DDP/FSDP wrappers
    state = {"model": get_model_state_dict(student)}
    with single_process_is_intended():
        dcp.load(state, checkpoint_id=checkpoint / "state", no_dist=True)
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
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    configure()

    def export() -> None:
        dest = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
        get_logger("export").info(f"wrote {dest} from {args.checkpoint}")

    return exit_code("stage2_train/export.py", export)


if __name__ == "__main__":
    sys.exit(main())
