"""`vocagno cache inspect`: one cached document as the student sees it under teacher guidance
(the paper's Figure 8), as a self-contained HTML page.

Each student token is shaded by its excess loss (student loss - aggregated teacher loss), drawn
solid if the top-k selection keeps it and dashed if it is dropped; hovering shows the teacher
tokens it maps to with their cached losses. The student's per-token loss needs the student model;
the teacher's comes from the cache, so no teacher is loaded.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.cache.manifest import load_manifest
from pipeline.cache.schema import DOC_ID, LOSS, TEXT, TOKEN_END, TOKEN_START, iter_shard_batches
from pipeline.cache.verify import verify_shard
from pipeline.cross_entropy import token_loss
from pipeline.errors import CacheError
from pipeline.guidance import GuidanceSettings, select_tokens
from pipeline.io import atomic_write_text
from pipeline.teacher_loss import student_teacher_loss
from pipeline.tokenizer import TextTokenizer


@dataclass(frozen=True)
class CachedDocument:
    doc_id: str
    text: str
    token_start: np.ndarray
    token_end: np.ndarray
    loss: np.ndarray


def find_document(cache_dir: Path, doc_id: str | None, index: int) -> CachedDocument:
    """The document with `doc_id`, or else the `index`-th document of the cache (0-based)."""
    manifest = load_manifest(cache_dir)
    seen = 0
    columns = [DOC_ID, TEXT, TOKEN_START, TOKEN_END, LOSS]
    for record in manifest.shards:
        if doc_id is None and seen + record.rows <= index:
            seen += record.rows
            continue
        for batch in iter_shard_batches(verify_shard(cache_dir, record), columns):
            for row in batch.to_pylist():
                if (doc_id is None and seen == index) or row[DOC_ID] == doc_id:
                    return CachedDocument(
                        row[DOC_ID],
                        row[TEXT],
                        np.asarray(row[TOKEN_START], dtype=np.int64),
                        np.asarray(row[TOKEN_END], dtype=np.int64),
                        np.asarray(row[LOSS], dtype=np.float32),
                    )
                seen += 1
    wanted = f"document {doc_id!r}" if doc_id is not None else f"document number {index}"
    raise CacheError(f"{wanted} is not in {cache_dir} ({manifest.total_rows} documents)")


@torch.inference_mode()
def guided_tokens(
    document: CachedDocument,
    model,
    tokenizer: TextTokenizer,
    settings: GuidanceSettings,
    aggregate: str,
) -> dict[str, np.ndarray]:
    """Per student token: span, mapped teacher range, student/teacher/excess loss, kept."""
    encoding = tokenizer.encode(document.text, add_eos=True)
    mapping = student_teacher_loss(
        encoding.start,
        encoding.end,
        [len(encoding)],
        document.token_start,
        document.token_end,
        document.loss,
        [len(document.loss)],
        [len(document.text)],
        aggregate=aggregate,
    )
    map_start, map_end, teacher = mapping.map_start, mapping.map_end, mapping.teacher_loss
    ids = torch.as_tensor(encoding.ids, dtype=torch.long)[None]
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device)).logits.float().cpu()
    # Position t predicts token t + 1: the first token has no student loss and is never trained.
    student = np.full(len(encoding), np.nan, dtype=np.float32)
    student[1:] = token_loss(logits[:, :-1], ids[:, 1:])[0].numpy()
    valid = torch.zeros(1, len(encoding), dtype=torch.bool)
    valid[0, 1:] = True
    keep = select_tokens(
        torch.from_numpy(np.nan_to_num(student))[None],
        torch.from_numpy(teacher)[None],
        valid,
        settings,
        torch.Generator().manual_seed(0),
    )[0].numpy()
    return {
        "start": encoding.start, "end": encoding.end, "map_start": map_start,
        "map_end": map_end, "student_loss": student, "teacher_loss": teacher,
        "excess_loss": student - teacher, "kept": keep, "valid": valid[0].numpy(),
    }  # fmt: skip


def _shade(excess: float, scale: float) -> str:
    """Red for tokens the student has most to learn (high excess), blue for negative excess."""
    if not np.isfinite(excess):
        return "#eeeeee"
    strength = min(abs(excess) / scale, 1.0)
    if excess >= 0:
        return f"rgba(220, 50, 32, {0.15 + 0.75 * strength:.2f})"
    return f"rgba(40, 90, 200, {0.15 + 0.75 * strength:.2f})"


def render_page(document: CachedDocument, tokens: dict[str, np.ndarray], title: str) -> str:
    text = document.text
    excess = tokens["excess_loss"]
    finite = excess[np.isfinite(excess)]
    scale = float(np.percentile(np.abs(finite), 95)) if finite.size else 1.0
    spans = []
    for i in range(len(tokens["start"])):
        start, end = int(tokens["start"][i]), int(tokens["end"][i])
        piece = text[start:end] if end > start else ("⟨bos⟩" if i == 0 else "⟨eos⟩")
        j, k = int(tokens["map_start"][i]), int(tokens["map_end"][i])
        if j >= 0:
            teacher = " | ".join(
                f"{text[document.token_start[t] : document.token_end[t]]!r}: {document.loss[t]:.2f}"
                for t in range(j, k + 1)
            )
        else:
            teacher = "unmapped"
        tip = (
            f"student {tokens['student_loss'][i]:.2f}, teacher {tokens['teacher_loss'][i]:.2f}, "
            f"excess {excess[i]:.2f}; teacher tokens [{j}..{k}]: {teacher}"
        )
        state = "kept" if tokens["kept"][i] else ("dropped" if tokens["valid"][i] else "context")
        spans.append(
            f'<span class="{state}" style="background:{_shade(float(excess[i]), scale)}" '
            f'title="{html.escape(tip)}">{html.escape(piece)}</span>'
        )
    kept = int(tokens["kept"].sum())
    valid = int(tokens["valid"].sum())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
.doc {{ font-family: monospace; white-space: pre-wrap; line-height: 2; }}
.doc span {{ padding: 1px 0; border-radius: 3px; }}
.kept {{ border: 2px solid #202020; }}
.dropped {{ border: 1px dashed #999; opacity: 0.75; }}
.context {{ border: 1px dotted #ccc; }}
</style></head><body>
<h2>{html.escape(title)}</h2>
<p>Document <code>{html.escape(document.doc_id)}</code>: {valid} trained positions, {kept} kept
({kept / max(valid, 1):.0%}). Shade: excess loss = student loss - teacher loss (red: the
student has more to learn than the teacher; blue: less). Solid border: kept by the top-k
selection; dashed: dropped. Hover a token for its losses and the teacher tokens it maps to.</p>
<div class="doc">{"".join(spans)}</div>
</body></html>
"""


def write_guidance_page(dest: Path, document: CachedDocument, tokens: dict, title: str) -> None:
    atomic_write_text(dest, render_page(document, tokens, title))
