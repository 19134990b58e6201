"""Paper Figures 3 and 6: how well equal chunks line up, against token-level lexical alignment.

Both tokenizations of a document are cut into N equal chunks (the chunking baseline maps student
chunk c to teacher chunk c) and each chunk pair is scored by character IoU and IoS (intersection
over the student chunk). The token-level reference scores each student token against the span of
the teacher range `align` maps it to. Means are pooled over all chunk pairs (or student tokens)
of all documents.

The chunks are the ones `--guidance chunk` trains with (pipeline.alignment.equal_chunk_alignment,
both sides cut by `chunk_bounds`): the student side is tokenized as stage 2 tokenizes it (BOS per
the student's policy, EOS appended) and the teacher side as stage 1 caches it (BOS per the
teacher's policy, no EOS). Framing tokens carry no characters, but they count towards the equal
split, so leaving them out would measure another chunking than the one trained.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from apps.analysis.configs import ChunkOverlapConfig
from apps.analysis.markdown import markdown_page
from pipeline.alignment import align, chunk_alignment_overlap, token_alignment_overlap
from pipeline.cache.manifest import SkippedDocument
from pipeline.config import to_dict
from pipeline.io import atomic_write_json, atomic_write_text, fingerprint
from pipeline.tokenizer import TextTokenizer
from pipeline.versions import software_versions

JSON_NAME = "chunk_overlap.json"
MARKDOWN_NAME = "chunk_overlap.md"
PNG_NAME = "chunk_overlap.png"
_BATCH_DOCS = 64


@dataclass
class _OverlapSums:
    """Running sums of IoU and IoS over scored items, and how many items were not scorable."""

    iou: float = 0.0
    ios: float = 0.0
    scored: int = 0
    unscored: int = 0

    def add(self, iou: np.ndarray, ios: np.ndarray) -> None:
        ok = ~np.isnan(iou)
        self.iou += float(iou[ok].sum())
        self.ios += float(ios[ok].sum())
        self.scored += int(ok.sum())
        self.unscored += int((~ok).sum())

    def means(self) -> dict:
        n = max(self.scored, 1)
        iou, ios = (self.iou / n, self.ios / n) if self.scored else (None, None)
        return {"iou": iou, "ios": ios, "scored": self.scored, "unscored": self.unscored}


@dataclass
class ChunkOverlap:
    """Mean character IoU/IoS per chunk count, and of token-level lexical alignment."""

    documents: int = 0
    student_tokens: int = 0
    teacher_tokens: int = 0
    by_chunks: dict[int, _OverlapSums] = field(default_factory=dict)
    token_level: _OverlapSums = field(default_factory=_OverlapSums)

    def to_json(self) -> dict:
        return {
            "documents": self.documents,
            "student_tokens": self.student_tokens,
            "teacher_tokens": self.teacher_tokens,
            # "scored" counts chunk pairs; "unscored" pairs have an empty side (document shorter
            # than the chunk count).
            "chunks": [{"num_chunks": n, **s.means()} for n, s in sorted(self.by_chunks.items())],
            # "scored" counts student tokens with characters; "unscored" ones have no teacher token.
            "token_level": self.token_level.means(),
        }


def measure_chunk_overlap(
    student: TextTokenizer,
    teacher: TextTokenizer,
    texts: Iterable[str],
    chunk_counts: list[int],
    progress=None,
) -> ChunkOverlap:
    """Tokenize each text with both tokenizers and pool the overlap of every alignment."""
    result = ChunkOverlap(by_chunks={n: _OverlapSums() for n in chunk_counts})
    texts = iter(texts)
    while batch := list(itertools.islice(texts, _BATCH_DOCS)):
        students = student.encode_batch(batch, add_eos=True)  # as stage 2 (documents.annotate)
        teachers = teacher.encode_batch(batch)  # as stage 1 caches it
        for s, t in zip(students, teachers, strict=True):
            for n, sums in result.by_chunks.items():
                sums.add(*chunk_alignment_overlap(s.start, s.end, t.start, t.end, n))
            map_start, map_end = align(s.start, s.end, t.start, t.end)
            iou, ios = token_alignment_overlap(s.start, s.end, t.start, t.end, map_start, map_end)
            has_chars = s.end > s.start  # zero-width tokens have nothing to cover
            result.token_level.add(iou[has_chars], ios[has_chars])
            result.student_tokens += len(s)
            result.teacher_tokens += len(t)
        result.documents += len(batch)
        if progress is not None:
            progress.update(len(batch))
    return result


def run_chunk_overlap(config: ChunkOverlapConfig) -> dict:
    """Measure on the corpus, write JSON + Markdown + PNG into `config.out`; returns the JSON."""
    from tqdm import tqdm

    from pipeline.corpus import Corpus, CorpusOptions
    from pipeline.tokenizer import load_tokenizer

    student = load_tokenizer(config.student_tokenizer)
    teacher = load_tokenizer(config.teacher_tokenizer)
    corpus = Corpus(
        config.input,
        CorpusOptions(text_column=config.text_column, on_bad_record=config.on_bad_record),
    )
    skipped: list[SkippedDocument] = []

    def texts():
        for item in corpus:
            if isinstance(item, SkippedDocument):
                skipped.append(item)
                continue
            yield item.text

    documents = itertools.islice(texts(), config.num_docs)
    with tqdm(total=config.num_docs, unit="doc", desc="chunk overlap", disable=None) as bar:
        overlap = measure_chunk_overlap(student, teacher, documents, config.chunks, progress=bar)

    producer = {
        "analysis": "chunk_overlap",
        "config": {k: v for k, v in to_dict(config).items() if k != "out"},
        "student_tokenizer": _tokenizer_record(student),
        "teacher_tokenizer": _tokenizer_record(teacher),
        "corpus": corpus.describe(),
        "software": software_versions(),
    }
    report = {
        **producer,
        "fingerprint": fingerprint(producer),
        **overlap.to_json(),
        "skipped": [dataclasses.asdict(s) for s in skipped],
    }
    atomic_write_json(config.out / JSON_NAME, report)
    atomic_write_text(config.out / MARKDOWN_NAME, chunk_overlap_markdown(report))
    plot_chunk_overlap(report, config.out / PNG_NAME)
    return report


def _tokenizer_record(tokenizer: TextTokenizer) -> dict:
    return {"spec": tokenizer.spec, "fingerprint": tokenizer.fingerprint}


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def chunk_overlap_markdown(report: dict) -> str:
    student, teacher = report["student_tokenizer"]["spec"], report["teacher_tokenizer"]["spec"]
    token = report["token_level"]
    table = [
        "| alignment | IoU | IoS | pairs scored | pairs with an empty side |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in report["chunks"]:
        chunks = f"{row['num_chunks']} equal chunk" + ("s" if row["num_chunks"] > 1 else "")
        table.append(
            f"| {chunks} | {_percent(row['iou'])} | {_percent(row['ios'])} | {row['scored']} "
            f"| {row['unscored']} |"
        )
    table.append(
        f"| token-level lexical alignment | {_percent(token['iou'])} | {_percent(token['ios'])} "
        f"| {token['scored']} tokens | {token['unscored']} unmapped |"
    )
    return markdown_page(
        f"Character overlap of aligned spans: student {student}, teacher {teacher}",
        f"{report['documents']} documents of `{report['config']['input']}` "
        f"({report['student_tokens']} student / {report['teacher_tokens']} teacher tokens)"
        + (f"; {len(report['skipped'])} malformed records skipped." if report["skipped"] else "."),
        table,
        "IoU: shared characters over the union of the two spans. IoS: shared characters over the "
        "student span (how much of the student text the teacher side covers).",
        report["fingerprint"],
        f"{JSON_NAME} for the configuration",
    )


def plot_chunk_overlap(report: dict, dest: Path) -> None:
    from apps.analysis.plotting import new_figure, save_png

    rows = [r for r in report["chunks"] if r["iou"] is not None]
    counts = [r["num_chunks"] for r in rows]
    token = report["token_level"]
    fig, (ax,) = new_figure()
    ax.plot(counts, [100 * r["iou"] for r in rows], "o-", color="tab:blue", label="chunk IoU")
    ax.plot(counts, [100 * r["ios"] for r in rows], "s-", color="tab:orange", label="chunk IoS")
    if token["iou"] is not None:
        ax.axhline(100 * token["iou"], ls="--", color="tab:blue", label="token-level IoU")
        ax.axhline(100 * token["ios"], ls="--", color="tab:orange", label="token-level IoS")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("number of chunks")
    ax.set_ylabel("character overlap (%)")
    ax.set_ylim(0, 105)
    ax.set_title(
        f"{report['student_tokenizer']['spec']} vs {report['teacher_tokenizer']['spec']}, "
        f"{report['documents']} documents",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    save_png(fig, dest, f"vocagno chunk_overlap {report['fingerprint']}")
