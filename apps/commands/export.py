"""`vocagno export CHECKPOINT --out DIR`: a stage-2 checkpoint as a model folder."""

from __future__ import annotations

from pathlib import Path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a stage-2 checkpoint (OUT/checkpoints/step-N) as a model folder",
        description="Write the student of a stage-2 checkpoint as OUT/final is written (weights "
        "by save_pretrained, its tokenizer, vocagno.json naming the checkpoint), so that `vocagno "
        "eval` or transformers can read a run's intermediate steps. The optimizer's state is not "
        "read.",
    )
    parser.add_argument("checkpoint", type=Path, help="a complete OUT/checkpoints/step-N folder")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.set_defaults(func=run_export)


def run_export(args) -> int:
    from pipeline.log import get_logger
    from stage2_train.export import export_checkpoint

    dest = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    get_logger("export").info(f"wrote {dest} from {args.checkpoint}")
    return 0
