"""`vocagno analyze selection`: what teacher-guided selection keeps, measured before any GPU-hour
is spent on it.

Excess-loss selection (paper eq. 4) helps when it points the student at tokens it can still learn
and the teacher already knows. Against a student that has not learned the easy tokens yet, the
ranking can follow the teacher instead: the tokens the teacher predicts well (often what it can
copy from earlier in the text) have low teacher loss and so high excess, while frequent tokens the
student still gets wrong but the teacher also finds hard are never kept. This report shows which
case a run is in, over a sample of the cache:

- the share of the student's loss that the kept tokens carry, against a `random` selection of the
  same size (the control of the same candidates);
- the rank correlation (Spearman) of excess with the student's loss and with minus the teacher's:
  which side the ranking follows;
- the most frequent student token types that are (almost) never kept, with their share of the
  tokens and of the student's loss.

The numbers come from the code stage 2 trains with: its data path (`stage2_train.data`: the same
packing, alignment and teacher-loss aggregation, micro-batch by micro-batch), its per-token loss
(`pipeline.head_outputs`) and its selection (`pipeline.guidance.select_tokens`), with the run's
shape: a selection ranks one rank's micro-batch (the default scope), so `--seq-len` and
`--micro-batch-size` should be the run's.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from apps.analysis.configs import SelectionConfig
from apps.analysis.markdown import markdown_page
from pipeline.config import to_dict
from pipeline.io import atomic_write_json, atomic_write_text, fingerprint
from pipeline.log import get_logger
from pipeline.versions import software_versions

JSON_NAME = "selection.json"
MARKDOWN_NAME = "selection.md"

log = get_logger("analyze").info


@dataclass(frozen=True)
class SelectionSample:
    """Per target token of the sample (micro-batches concatenated, valid targets only)."""

    token_id: np.ndarray  # int64, the student's target token
    student_loss: np.ndarray  # float32, nats
    teacher_loss: np.ndarray  # float32, the aggregated teacher loss (eq. 2); NaN = unmapped
    kept: np.ndarray  # bool, kept by the guidance mode
    random_kept: np.ndarray  # bool, kept by `random` with the same settings (the same count)


def rank_average(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span (Spearman's convention)."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    first = np.concatenate(([True], sorted_values[1:] != sorted_values[:-1]))
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], len(values))  # one past each tie group
    mean_rank = (starts + 1 + ends) / 2.0  # the mean of ranks starts+1 .. ends
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = mean_rank[group]
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation; None with fewer than two values or a constant side."""
    if len(a) < 2:
        return None
    ra, rb = rank_average(np.asarray(a, np.float64)), rank_average(np.asarray(b, np.float64))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    scale = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return None if scale == 0 else float((ra * rb).sum() / scale)


def selection_statistics(
    sample: SelectionSample, min_count: int, max_kept_rate: float, top: int
) -> dict:
    """The report's numbers from a sample (pure: the test computes them independently)."""
    loss = sample.student_loss.astype(np.float64)
    total = loss.sum()
    tokens = len(loss)
    mapped = ~np.isnan(sample.teacher_loss)
    teacher = sample.teacher_loss.astype(np.float64)
    excess = loss[mapped] - teacher[mapped]

    ids, inverse = np.unique(sample.token_id, return_inverse=True)
    count = np.bincount(inverse, minlength=len(ids))
    kept = np.bincount(inverse, weights=sample.kept, minlength=len(ids))
    type_loss = np.bincount(inverse, weights=loss, minlength=len(ids))
    type_mapped = np.bincount(inverse[mapped], minlength=len(ids))
    type_teacher = np.bincount(inverse[mapped], weights=teacher[mapped], minlength=len(ids))
    seldom = (count >= min_count) & (kept <= max_kept_rate * count)
    order = [i for i in np.lexsort((ids, -count)) if seldom[i]]  # most frequent first
    rows = [
        {
            "token_id": int(ids[i]),
            "count": int(count[i]),
            "kept": int(kept[i]),
            "token_share": count[i] / tokens,
            "loss_share": type_loss[i] / total,
            "student_loss": type_loss[i] / count[i],
            "teacher_loss": type_teacher[i] / type_mapped[i] if type_mapped[i] else None,
        }
        for i in order[:top]
    ]
    return {
        "tokens": tokens,
        "mapped_fraction": mapped.mean(),
        "kept_fraction": sample.kept.mean(),
        "random_kept_fraction": sample.random_kept.mean(),
        "kept_loss_share": loss[sample.kept].sum() / total,
        "random_loss_share": loss[sample.random_kept].sum() / total,
        "student_loss_mean": loss.mean(),
        "teacher_loss_mean": teacher[mapped].mean() if mapped.any() else None,
        "excess_vs_student_loss": spearman(excess, loss[mapped]),
        "excess_vs_minus_teacher_loss": spearman(excess, -teacher[mapped]),
        "seldom_kept": {
            "min_count": min_count,
            "max_kept_rate": max_kept_rate,
            "types": int(seldom.sum()),
            "token_share": count[seldom].sum() / tokens,
            "loss_share": type_loss[seldom].sum() / total,
            "most_frequent": rows,
        },
    }


def sample_selection(config: SelectionConfig) -> tuple[SelectionSample, dict]:
    """Stage 2's micro-batches of the cache, from its first, each scored by the student and
    selected as stage 2 selects, until `config.tokens` targets (or one pass over the cache).
    Returns the sample and the resolved settings that made it."""
    import torch

    from pipeline.cache.manifest import load_manifest
    from pipeline.cross_entropy import IGNORE_INDEX
    from pipeline.errors import ConfigError
    from pipeline.guidance import GuidanceSettings, select_tokens
    from pipeline.head_outputs import HeadReads, head_outputs
    from pipeline.models.student import load_trained_student, student_tokenizer_spec
    from pipeline.tokenizer import load_tokenizer
    from stage2_train.attention import student_logits
    from stage2_train.data.documents import choose_alignment
    from stage2_train.data.more_teachers import run_cache_fingerprint, teacher_settings
    from stage2_train.data.plan import DataPlan, has_target_spans
    from stage2_train.data.streams import consumer_stream

    defaults = GuidanceSettings()  # stage 2's: the method's selection, `token`
    try:
        settings = GuidanceSettings(
            topk=defaults.topk if config.topk is None else config.topk,
            unmapped=config.unmapped or defaults.unmapped,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    control = dataclasses.replace(settings, mode="random")
    manifest = load_manifest(config.cache)
    more = {location: load_manifest(location) for location in config.more_caches}
    tokenizer = load_tokenizer(student_tokenizer_spec(config.student, config.student_tokenizer))
    model = load_trained_student(config.student)
    align = functools.partial(choose_alignment, settings, tokenizer.fingerprint)
    plan = DataPlan(
        cache_dir=config.cache,
        shards=tuple(manifest.shards),
        student_tokenizer=tokenizer.spec,
        alignment=align(manifest.tokenizer),
        aggregate=config.aggregate,
        packing=config.packing,
        seq_len=config.seq_len,
        micro_batch_size=config.micro_batch_size,
        seed=config.seed,
        target_spans=has_target_spans(manifest),
        **teacher_settings(config, config, manifest, more, align),
    )
    parts: list[tuple[np.ndarray, ...]] = []
    seen = 0
    device = torch.device("cpu")
    with torch.inference_mode():
        for micro, batch in enumerate(consumer_stream(plan, 0)):
            if seen >= config.tokens or any(epoch > 0 for epoch, _ in batch["documents"]):
                break  # enough targets, or the cache read once
            labels = batch["labels"]
            valid = labels != IGNORE_INDEX
            loss = head_outputs(student_logits(model, batch, device), labels, HeadReads()).loss
            teacher = batch["teacher_loss"]
            kept = select_tokens(loss, teacher, valid, settings)
            noise = torch.Generator().manual_seed(int(np.random.SeedSequence(
                [config.seed, micro]).generate_state(1)[0]))  # fmt: skip
            random_kept = select_tokens(loss, teacher, valid, control, noise)
            parts.append(
                tuple(t[valid].numpy() for t in (labels, loss, teacher, kept, random_kept))
            )
            seen += int(valid.sum())
            if micro % 16 == 15:
                log(f"selection sample: {seen:,} of {config.tokens:,} target tokens")
    if not parts:
        raise ConfigError(f"{config.cache}: no target token in the sample")
    sample = SelectionSample(*(np.concatenate(column) for column in zip(*parts, strict=True)))
    resolved = {
        "guidance": dataclasses.asdict(settings),
        "alignment": plan.alignment,
        "student_tokenizer": tokenizer.spec,
        "student_tokenizer_fingerprint": tokenizer.fingerprint,
        "cache_fingerprint": run_cache_fingerprint(manifest, plan.more_caches),
        "teacher": manifest.teacher,
        "more_teachers": [other.teacher for other in more.values()],
        "one_pass": seen < config.tokens,
    }
    return sample, resolved


def run_selection_report(config: SelectionConfig) -> dict:
    """Sample, measure, and write selection.json and selection.md into `config.out`."""
    from pipeline.tokenizer import load_tokenizer

    sample, resolved = sample_selection(config)
    statistics = selection_statistics(sample, config.min_count, config.max_kept_rate, config.top)
    tokenizer = load_tokenizer(resolved["student_tokenizer"])
    for row in statistics["seldom_kept"]["most_frequent"]:
        row["text"] = tokenizer.backend.id_to_token(row["token_id"])  # the raw piece
    producer = {
        "analysis": "selection",
        "config": {k: v for k, v in to_dict(config).items() if k != "out"},
        "resolved": resolved,
        "software": software_versions(),
    }
    report = {**producer, "fingerprint": fingerprint(producer), "statistics": statistics}
    atomic_write_json(config.out / JSON_NAME, report)
    atomic_write_text(config.out / MARKDOWN_NAME, selection_markdown(report))
    return report


def summary_lines(statistics: dict) -> list[str]:
    """The report's headline, as the command prints it."""

    def corr(value: float | None) -> str:
        return "n/a" if value is None else f"{value:+.2f}"

    seldom = statistics["seldom_kept"]
    return [
        f"{statistics['tokens']:,} target tokens, {statistics['mapped_fraction']:.1%} mapped, "
        f"{statistics['kept_fraction']:.1%} kept",
        f"kept tokens carry {statistics['kept_loss_share']:.1%} of the student's loss; a random "
        f"selection of the same size {statistics['random_loss_share']:.1%}",
        f"rank correlation of excess loss with the student's loss "
        f"{corr(statistics['excess_vs_student_loss'])}, with minus the teacher's "
        f"{corr(statistics['excess_vs_minus_teacher_loss'])}",
        f"{seldom['types']} token types seen {seldom['min_count']}+ times are kept at most "
        f"{seldom['max_kept_rate']:.0%} of the time: {seldom['token_share']:.1%} of the tokens, "
        f"{seldom['loss_share']:.1%} of the student's loss",
    ]


def selection_markdown(report: dict) -> str:
    statistics = report["statistics"]
    table = [
        "| token | count | kept | share of tokens | share of student loss | student loss "
        "| teacher loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in statistics["seldom_kept"]["most_frequent"]:
        teacher = "unmapped" if row["teacher_loss"] is None else f"{row['teacher_loss']:.2f}"
        table.append(
            f"| `{row['text']!r}` | {row['count']:,} | {row['kept']:,} | "
            f"{row['token_share']:.2%} | {row['loss_share']:.2%} | {row['student_loss']:.2f} | "
            f"{teacher} |"
        )
    intro = "\n".join(f"- {line}" for line in summary_lines(statistics))
    note = (
        "Losses in nats per token. The kept tokens' share of the student's loss is the share of "
        "the learning signal the selection trains on; near the random selection's share, or a "
        "correlation that follows the teacher's loss more than the student's, says the ranking "
        "reflects what the teacher predicts rather than what the student has left to learn."
    )
    return markdown_page(
        "What teacher-guided selection keeps", intro, table, note, report["fingerprint"],
        JSON_NAME,
    )  # fmt: skip
