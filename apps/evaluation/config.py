"""Options of `vocagno eval` (`[eval]` in a TOML manifest)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.choices import NamedChatTemplate, OnBadRecord, Targets, TorchDtype
from pipeline.config import option

SECTION = "eval"


@dataclass(frozen=True)
class EvalConfig:
    model: str = option(help="model to evaluate: a Hugging Face folder, a .gguf file, or a hub id")
    tokenizer: str | None = option(None, help="tokenizer, if not the model's own")
    data: str | None = option(
        None, help="held-out documents (any corpus spec); unset: the shipped GSM-style eval split"
    )
    shots_data: str | None = option(
        None, help="where the few-shot examples come from; unset: the shipped train split"
    )
    on_bad_record: OnBadRecord = option(
        "error",
        help="a malformed held-out record stops with its file and record (error), or is passed "
        "over and counted in the report's skipped_records (skip)",
    )
    targets: Targets = option(
        "all",
        help="the answer of each problem: all: its text after '\\nAnswer:'; spans or chat: its "
        "target spans, as stage 1's --targets reads them (field target_spans or messages)",
    )
    chat_template: NamedChatTemplate = option(
        "chatml", help="--targets chat: as stage 1's chatml or plain (not a tokenizer's own)"
    )
    num_docs: int = option(200, help="held-out documents for bits per character (0: skip)")
    last_words: bool = option(
        False,
        help="also the greedy accuracy of the last word of each line of those documents "
        "(LAMBADA-style; apps/evaluation/last_word.py)",
    )
    answer_problems: int = option(
        200,
        help="held-out problems for answer bits per character given the question, the primary "
        "metric (README; it compares models across tokenizers) (0: skip)",
    )
    accuracy_problems: int = option(
        50, help="held-out problems for greedy answer accuracy (0: skip)"
    )
    shots: int = option(3, help="worked examples before each question")
    max_new_tokens: int = option(160, help="generation budget per problem")
    generation_batch: int = option(8, help="problems generated at once")
    max_length: int | None = option(
        None, help="tokens per scoring window; unset: the model's context length"
    )
    batch_tokens: int = option(8192, help="padded tokens per scoring batch")
    dtype: TorchDtype = option("float32", help="dtype of the weights (losses are computed in fp32)")
    out: Path | None = option(None, help="also write the report as JSON here")

    def __post_init__(self) -> None:
        for name in ("num_docs", "answer_problems", "accuracy_problems", "shots"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("max_new_tokens", "generation_batch", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be at least 2, not {self.max_length}")
        if self.targets != "all" and self.accuracy_problems:
            raise ValueError(
                "answer accuracy reads 'Question: ... Answer:' problems, not target spans: with "
                f"--targets {self.targets} pass --accuracy-problems 0 (answer bits use the spans)"
            )
        if self.last_words and not self.num_docs:
            raise ValueError("last_words reads the num_docs documents: give num_docs > 0")
        if self.num_docs == 0 and self.answer_problems == 0 and self.accuracy_problems == 0:
            raise ValueError(
                "nothing to do: num_docs, answer_problems and accuracy_problems are all 0"
            )
