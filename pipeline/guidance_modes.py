"""The guidance modes, each declared once: what it ranks by, which alignment the data path must
give it (and so which unit it selects), and where the paper defines it. The CLI's choices and
help, the demo's arms, stage 2's choice of alignment and the selection (pipeline.guidance) all
read `MODES`; adding a mode is one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.cache.settings import CacheSettings


@dataclass(frozen=True)
class ModeDeclaration:
    """What one guidance mode is: the CLI's choices, the demo's arms, the data path's alignment
    and the selection all read this declaration; nothing branches on a mode's name."""

    name: str
    rank_by: Literal["excess", "noise", "nothing"]  # nothing: no selection, every token kept
    # how the data path gives each token its L_T, and so what the top-k counts and keeps: a
    # chunk mode's teacher losses are its chunks', and it selects whole chunks
    alignment: Literal["token", "chunk"]
    paper: str  # where the paper defines it
    summary: str
    # a distillation term trained beside the cross-entropy (pipeline.distillation), built from
    # the run's guidance options (stage 2's GuidanceOptions), the cache's settings (its
    # manifest's) and the student's (ModelOptions: ALM's space mask is its tokenizer's)
    distillation: Callable[[Any, CacheSettings, Any], Any] | None = None
    # the term compares distributions over one vocabulary (KLD): refused unless the student's
    # tokenizer is the cache's
    same_tokenizer: bool = False

    @property
    def needs_chunks(self) -> bool:
        return self.alignment == "chunk"


def _uld(options: Any, cache_settings: CacheSettings, student: Any) -> Any:  # imported when a run asks for it: torch and the cache schema
    from pipeline.distillation.uld import UniversalLogitDistillation

    return UniversalLogitDistillation(weight=options.uld_lambda)


def _kld(options: Any, cache_settings: CacheSettings, student: Any) -> Any:
    from pipeline.distillation.kld import TopkKLDistillation

    return TopkKLDistillation()


def _kld_sampled(options: Any, cache_settings: CacheSettings, student: Any) -> Any:
    from pipeline.distillation.sampled import SampledKLDistillation

    return SampledKLDistillation()


def _uld_sampled(options: Any, cache_settings: CacheSettings, student: Any) -> Any:
    from pipeline.distillation.sampled import SampledULDistillation
    from pipeline.errors import CacheError

    head_size = cache_settings.sample_head_size
    if cache_settings.sampled and head_size is None:
        raise CacheError(
            "--guidance uld-sampled needs the teacher's head size, which this sampled cache "
            "does not record (it was scored before it was saved): score it again with stage 1"
        )
    # a cache of no draws gets 0 here and is refused for its columns (stage 2's preflight)
    return SampledULDistillation(weight=options.uld_lambda, teacher_vocab=head_size or 0)


def _alm(options: Any, cache_settings: CacheSettings, student: Any) -> Any:
    from pipeline.distillation.alm import alm_distillation  # torch: only when a run asks for it

    return alm_distillation(options, student)


MODES: dict[str, ModeDeclaration] = {
    mode.name: mode
    for mode in (
        ModeDeclaration(
            "token", "excess", "token", "eq. 3-4, Table 1 'Ours'",
            "the method: top-k tokens by excess loss over token-aligned teacher loss",
        ),
        ModeDeclaration(
            "chunk", "excess", "chunk", "Table 2 'Chunking Alignment / Teacher'",
            "equal chunks per document, chunk c to chunk c; top-k CHUNKS by chunk excess loss",
        ),
        ModeDeclaration(
            "random", "noise", "token", "no row; the token-level control",
            "as many tokens as token keeps, chosen at random (seeded)",
        ),
        ModeDeclaration(
            "random-chunk", "noise", "chunk", "Table 2 'Chunking Alignment / Random'",
            "as many chunks as chunk keeps, chosen at random (seeded)",
        ),
        ModeDeclaration(
            "none", "nothing", "token", "Table 1 'TinyLlama-CPT'",
            "every token (plain continual pretraining)",
        ),
        ModeDeclaration(
            "uld", "nothing", "token", "Table 1 'ULD', appendix B eq. 6",
            "every token's cross-entropy + --uld-lambda x Wasserstein-1 between the sorted "
            "student and cached teacher top-k (needs a --topk-probs cache)",
            distillation=_uld,
        ),
        ModeDeclaration(
            "kld", "nothing", "token", "Table 1 'KLD', appendix B eq. 5",
            "every token's cross-entropy + KL(student || teacher) over the cached top-k ids and "
            "the rest (needs a --topk-probs cache of the student's own tokenizer)",
            distillation=_kld, same_tokenizer=True,
        ),
        ModeDeclaration(
            "kld-sampled", "nothing", "token",
            "no row; KLD (appendix B eq. 5) over the full vocabulary, forward, from teacher draws "
            "(Anshumann et al. 2025, arXiv:2503.16870)",
            "every token's cross-entropy + an unbiased estimate of the full KL(teacher || student) "
            "from K cached draws (needs a --topk-mode sampled cache of the student's tokenizer)",
            distillation=_kld_sampled, same_tokenizer=True,
        ),
        ModeDeclaration(
            "uld-sampled", "nothing", "token",
            "no row; ULD (appendix B eq. 6) over the full vocabulary, estimated from teacher draws",
            "every token's cross-entropy + --uld-lambda x an unbiased estimate of the full ULD "
            "distance from K cached draws and their ranks (needs a --topk-mode sampled cache)",
            distillation=_uld_sampled,
        ),
        ModeDeclaration(
            "alm", "nothing", "token",
            "no row; Minixhofer et al. 2025 (arXiv:2503.20083), tokenkit's defaults",
            "cross-entropy on every token + --alm-weight x ALM (approximate likelihood matching "
            "of text chunks; needs a stage-1 cache with --space-logprob, docs/alm.md)",
            distillation=_alm,
        ),
    )
}  # fmt: skip
GUIDANCE_MODES: tuple[str, ...] = tuple(MODES)
GuidanceMode = Literal[GUIDANCE_MODES]  # a config field's type: its flag's choices and help
