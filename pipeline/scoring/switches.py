"""The hf backend's device switches as one frozen record, in two states: as asked (any may be
`auto`: stage 1's `--head-kernel`, `--head-chunks`, `--row-packing`, `--attention`,
`--batch-overlap`, `--compile`), and as resolved for a device and a teacher
(pipeline.scoring.resolve, which decides every switch), which is what the scorer steps with, what
`describe()` reports, what stage1-run.json saves for each run and each shard's sidecar names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.choices import (
    Attention,
    BatchOverlap,
    CompileLayers,
    HeadChunks,
    HeadKernel,
    RowPacking,
)


@dataclass(frozen=True)
class HeadSwitches:
    head_kernel: HeadKernel = "auto"
    head_chunks: HeadChunks = "auto"
    row_packing: RowPacking = "auto"
    attention: Attention | None = "auto"  # resolved: None where rows are padded (no mask)
    batch_overlap: BatchOverlap = "auto"
    compile: CompileLayers = "auto"

    @classmethod
    def asked_by(cls, *sections) -> HeadSwitches:
        """The switches a config asks for, each read from the first of its `sections` that has
        it (stage 1's: the head's and the batching's)."""
        return cls(**{
            field.name: next(getattr(s, field.name) for s in sections if hasattr(s, field.name))
            for field in dataclasses.fields(cls)
        })  # fmt: skip

    def saved(self) -> dict[str, str | None]:
        return dataclasses.asdict(self)
