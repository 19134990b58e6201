"""Options of each analysis, as typed dataclasses: they build `vocagno analyze ...`'s command
line (kept free of heavy imports so that `--help` is instant) and are saved with every output."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.alignment import DEFAULT_AGGREGATION
from pipeline.choices import (
    Aggregation,
    OnBadRecord,
    Packing,
    TeacherCombination,
    UnmappedStrategy,
)
from pipeline.config import option
from pipeline.teacher_options import source_teachers
from pipeline.tokenizer import TOKENIZER_SPEC


@dataclass
class VocabularyOverlapConfig:
    student_tokenizer: str = option(help=f"student tokenizer: {TOKENIZER_SPEC}")
    teacher_tokenizers: list[str] = option(help=f"one or more teacher tokenizers: {TOKENIZER_SPEC}")
    out: Path = option("analysis", help="folder for vocab_overlap.{json,csv,md,png}")

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not self.teacher_tokenizers:
            raise ValueError("teacher_tokenizers: give at least one teacher tokenizer")
        if len(set(self.teacher_tokenizers)) != len(self.teacher_tokenizers):
            raise ValueError(f"teacher tokenizers must not repeat: {self.teacher_tokenizers}")


@dataclass
class ChunkOverlapConfig:
    student_tokenizer: str = option(help=f"student tokenizer: {TOKENIZER_SPEC}")
    teacher_tokenizer: str = option(help=f"teacher tokenizer: {TOKENIZER_SPEC}")
    input: str = option(
        help="corpus to measure on: JSON lines (plain or .zst), Parquet, text files, a saved "
        "`datasets` folder, or a folder or glob of these"
    )
    text_column: str = option("text", help="field or column holding each document's text")
    on_bad_record: OnBadRecord = option(
        "error",
        help="a malformed record (bad JSON, empty text, ...) stops the analysis (error), or is "
        "left out and listed in chunk_overlap.json (skip)",
    )
    num_docs: int = option(200, help="number of documents to measure, from the start of the corpus")
    chunks: list[int] = option(
        [1, 2, 4, 8, 16, 32, 64], help="numbers of equal chunks to cut each document into"
    )
    out: Path = option("analysis", help="folder for chunk_overlap.{json,md,png}")

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.num_docs < 1:
            raise ValueError(f"num_docs must be at least 1, not {self.num_docs}")
        if not self.chunks or min(self.chunks) < 1:
            raise ValueError(f"chunks must be at least 1, not {self.chunks}")
        if len(set(self.chunks)) != len(self.chunks):
            raise ValueError(f"chunk counts must not repeat: {self.chunks}")
        self.chunks = sorted(self.chunks)


@dataclass
class TrainingCurvesConfig:
    run_dirs: list[Path] = option(
        help="training run folders, each with the metrics.jsonl stage 2 writes; a run still in "
        "progress is fine"
    )
    out: Path = option("training_curves.png", help="PNG file to write")

    def __post_init__(self) -> None:
        self.run_dirs = [Path(d) for d in self.run_dirs]
        self.out = Path(self.out)
        if not self.run_dirs:
            raise ValueError("run_dirs: give at least one run folder")
        if len(set(self.run_dirs)) != len(self.run_dirs):
            raise ValueError(f"run folders must not repeat: {[str(d) for d in self.run_dirs]}")


@dataclass
class SelectionConfig:
    cache: str = option(help="stage-1 cache folder or URI (s3://..., gs://...)")
    student: str = option(
        help="the student as a model folder (a warm start, or a stage-2 run's final/ or export)"
    )
    student_tokenizer: str | None = option(
        None, help=f"the student's tokenizer; unset: the student folder's. {TOKENIZER_SPEC}"
    )
    tokens: int = option(32_768, help="target tokens to sample, from the stream's start")
    seq_len: int = option(2048, help="stage 2's --seq-len (a selection ranks one micro-batch)")
    micro_batch_size: int = option(4, help="stage 2's --micro-batch-size")
    packing: Packing = option("documents", help="stage 2's --packing")
    topk: float | None = option(None, help="stage 2's --topk; unset: stage 2's default")
    unmapped: UnmappedStrategy | None = option(
        None, help="stage 2's --unmapped; unset: stage 2's default"
    )
    aggregate: Aggregation = option(DEFAULT_AGGREGATION, help="stage 2's --aggregate")
    more_caches: list[str] = option([], help="stage 2's --more-caches: other teachers' caches")
    combine_teachers: TeacherCombination = option("min", help="stage 2's --combine-teachers")
    source_teachers: list[str] = option([], help="stage 2's --source-teachers")
    seed: int = option(0, help="stage 2's --seed (data order) and the random selection's seed")
    min_count: int = option(20, help="token types seen fewer times are not listed as seldom kept")
    max_kept_rate: float = option(
        0.05, help="a token type kept at most this share of its occurrences is seldom kept"
    )
    top: int = option(15, help="how many of the most frequent seldom-kept types to list")
    out: Path = option("analysis", help="folder for selection.{json,md}")

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        source_teachers(self.cache, self.more_caches, self.combine_teachers, self.source_teachers)
        for name in ("tokens", "seq_len", "micro_batch_size", "min_count", "top"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not 0 <= self.max_kept_rate < 1:
            raise ValueError(f"max_kept_rate must be in [0, 1), not {self.max_kept_rate}")
