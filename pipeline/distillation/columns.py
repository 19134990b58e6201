"""Whether a cache holds the columns a distillation mode reads, said in one line naming the
stage-1 option that adds them: stage 2's preflight and the experiments' checks before their first
step ask the same question of the same code. `guidance` is stage 2's GuidanceOptions (the mode,
and what each mode's distillation reads from it), `student` its ModelOptions (what ALM's
distillation is built with)."""

from __future__ import annotations

from typing import Any

from pipeline.cache.schema import COLUMN_OPTIONS, LOGICAL, extra_fields
from pipeline.cache.settings import CacheSettings
from pipeline.distillation import Distillation
from pipeline.errors import CacheError, VocagnoError
from pipeline.guidance_modes import MODES


def check_columns(
    guidance: Any,
    distillation: Distillation,
    cache: str,
    settings: CacheSettings,
    student: Any,
) -> None:
    """CacheError unless `cache` (a cache's description in words; `settings`, its manifest's)
    holds every column the distillation reads, naming the stage-1 option that adds it."""
    present = {LOGICAL.get(field.name, field.name) for field in extra_fields(settings)}
    missing = [name for name in distillation.cache_columns if name not in present]
    if not missing:
        return
    options = " and ".join(dict.fromkeys(COLUMN_OPTIONS[name] for name in missing))
    if settings.sampled and options.startswith("--topk-probs K"):
        options += " --topk-mode top"  # it has K entries a position, drawn ones
    readers = _modes_reading(present, guidance, settings, student)
    holds = f", or train from it with --guidance {' or '.join(readers)}" if readers else ""
    raise CacheError(
        f"--guidance {guidance.mode} reads the teacher's {', '.join(missing)}, which {cache} "
        f"does not hold ({_columns_held(settings)}): score the corpus with stage 1's "
        f"{options}{holds}"
    )


def _columns_held(settings: CacheSettings) -> str:
    if settings.sampled:
        return f"it holds {settings.topk_probs} sampled draws a position: --topk-mode sampled"
    if settings.topk_probs:
        return f"it holds the top-{settings.topk_probs}: --topk-mode top"
    return "it holds no teacher distribution"


def _modes_reading(
    present: set[str], guidance: Any, settings: CacheSettings, student: Any
) -> list[str]:
    """The distillation modes that read only columns a cache holds."""
    readers = []
    for name, mode in MODES.items():
        if mode.distillation is None:
            continue
        try:
            columns = mode.distillation(guidance, settings, student).cache_columns
        except VocagnoError:  # the mode refuses this cache for another reason
            continue
        if columns and set(columns) <= present:
            readers.append(name)
    return readers
