"""Options of a stage-1 run (`[stage1]` in a TOML job manifest, or flags of stage1_score/run.py);
which of them make the cache's identity and which change only its speed: stage1_score.identity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.cache.schema import topk_id_dtype
from pipeline.cache.settings import CacheSettings
from pipeline.choices import SAMPLED_NEEDS_PLAIN_HEAD
from pipeline.corpus import CorpusOptions
from stage1_score.identity import identity_mark
from stage1_score.options import (
    BatchingOptions,
    CorpusSection,
    HeadOptions,
    OutputOptions,
    TeacherOptions,
    VllmOptions,
    WorkersOptions,
)

SECTION = "stage1"


@dataclass(frozen=True)
class ScoreConfig:
    """Stage 1's options by section (stage1_score.options), in --help's order; each component
    is handed its section (the vLLM engine `config.vllm`), the whole config goes where a decision
    reads several (the driver, the worker, pipeline.scoring.resolve's `Asked.of`)."""

    help_mark: ClassVar = staticmethod(identity_mark)  # [identity] or [run only] in --help

    teacher: TeacherOptions
    corpus: CorpusSection
    output: OutputOptions
    batching: BatchingOptions
    head: HeadOptions
    workers: WorkersOptions
    vllm: VllmOptions

    def __post_init__(self) -> None:
        backend, output = self.teacher.backend, self.output
        if backend == "vllm" and output.space_logprob:
            raise ValueError(
                "--space-logprob needs --backend hf: vLLM returns log-probabilities of the top K "
                "and of asked-for ids only, and the space mask is thousands of ids at every "
                "position"
            )
        if output.topk_mode == "sampled":
            if backend == "vllm":
                raise ValueError(
                    "--topk-mode sampled needs --backend hf: vLLM returns the top K of each "
                    "prompt position, not draws from its distribution"
                )
            if self.head.head_kernel not in ("auto", "plain"):
                raise ValueError(SAMPLED_NEEDS_PLAIN_HEAD.format(kernel=self.head.head_kernel))

    def corpus_options(self) -> CorpusOptions:
        """The corpus reader's options (pipeline.corpus)."""
        return self.corpus.options()


def result_settings(
    config: ScoreConfig,
    max_length: int,
    stride: int,
    head_size: int | None = None,
    space_mask: dict | None = None,
) -> CacheSettings:
    """The settings that decide the cache's contents (besides teacher, tokenizer and corpus).
    `head_size` (the teacher's outputs) picks the ids' type and is a sampled cache's V_t;
    `space_mask` is pipeline.space_mask's identity of the mask used. An option that does not
    apply (the encoding of draws, the seed of a top-k cache) keeps its setting's default, so
    the settings are the ones the manifest reads back."""
    output = config.output
    topk = output.topk_probs
    sampled = bool(topk) and output.topk_mode == "sampled"
    if topk and output.topk_ids and head_size is None:
        raise ValueError("the teacher's head size is needed for top-k ids and draws")
    if output.space_logprob and space_mask is None:
        raise ValueError("the space mask's identity is needed for --space-logprob")
    unset = CacheSettings()
    return CacheSettings(
        max_length=max_length,
        stride=stride,
        docs_per_shard=config.batching.docs_per_shard,
        loss_dtype=output.loss_dtype,
        topk_probs=topk,
        topk_ids=output.topk_ids if topk else unset.topk_ids,
        topk_id_dtype=topk_id_dtype(head_size) if topk and output.topk_ids else None,
        topk_encoding=output.topk_encoding if topk and not sampled else unset.topk_encoding,
        topk_mode="sampled" if sampled else "top",
        sample_seed=output.sample_seed if sampled else unset.sample_seed,
        sample_head_size=head_size if sampled else None,
        target_spans=config.corpus.targets != "all",  # the shards carry each document's spans
        space_logprob=space_mask if output.space_logprob else None,
    )
