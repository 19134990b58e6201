"""Small real caches for stage 2 tests, written through the stage 1 contract functions.

Texts come from the shipped GSM-style corpus and are tokenized with a real shipped teacher
tokenizer; the teacher losses are seeded random values (NaN on the first token, which no teacher
predicts), so tests can check exactly where each loss lands without running a teacher.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pipeline.cache.manifest import CacheManifest, ShardRecord, write_manifest
from pipeline.cache.schema import (
    DOC_ID,
    SAMPLE_IDS,
    SAMPLE_LOGPROBS,
    SAMPLE_RANKS,
    SPACE_LOGPROB,
    TOPK_IDS,
    TOPK_PROBS,
    TOPK_REST,
    shard_name,
    topk_id_dtype,
    write_shard,
)
from pipeline.cache.settings import CacheSettings
from pipeline.cache.writer import build_unit_table
from pipeline.corpus import Corpus, CorpusOptions
from pipeline.io import sha256_text
from pipeline.shipped import shipped_corpus
from pipeline.tokenizer import load_tokenizer

CORPUS = shipped_corpus("train")


def corpus_documents(count: int, skip: int = 0) -> list[tuple[str, str]]:
    """(doc_id, text) of `count` shipped corpus documents."""
    docs = Corpus(CORPUS, CorpusOptions(id_column="id"))
    return [(d.doc_id, d.text) for d in itertools.islice(docs, skip, skip + count)]


def teacher_losses(num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    loss = rng.uniform(0.05, 6.0, num_tokens).astype(np.float32)
    loss[:1] = np.nan
    return loss


def teacher_topk(
    num_tokens: int, k: int, vocab_size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Seeded top-k columns of one document (docs/cache-columns.md): K distinct ids, descending
    probabilities of a random distribution over them plus the rest, NaN / -1 on the first token."""
    logits = rng.normal(0.0, 2.0, (num_tokens, k + 1))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    top = -np.sort(-probs[:, :k], axis=1)
    ids = (rng.integers(0, vocab_size, (num_tokens, 1)) + 7 * np.arange(k)) % vocab_size
    columns = {
        TOPK_PROBS: top.astype(np.float32),
        TOPK_IDS: ids.astype(np.int64),
        TOPK_REST: (1 - top.sum(1)).astype(np.float32),
    }
    columns[TOPK_PROBS][:1], columns[TOPK_IDS][:1], columns[TOPK_REST][:1] = np.nan, -1, np.nan
    return columns


def teacher_draws(
    num_tokens: int, k: int, vocab_size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Seeded columns of a sampled cache's document (`--topk-mode sampled`): K ids with their
    log-probabilities and ranks, -1 / NaN on the first token."""
    columns = {
        SAMPLE_IDS: rng.integers(0, vocab_size, (num_tokens, k)).astype(np.int64),
        SAMPLE_LOGPROBS: np.log(rng.uniform(1e-3, 0.9, (num_tokens, k))).astype(np.float32),
        SAMPLE_RANKS: rng.integers(0, 50, (num_tokens, k)).astype(np.int64),
    }
    columns[SAMPLE_IDS][:1], columns[SAMPLE_LOGPROBS][:1], columns[SAMPLE_RANKS][:1] = -1, np.nan, -1
    return columns


def build_cache(
    dest: Path,
    *,
    teacher_tokenizer: str = "qwen2.5",
    documents: list[tuple[str, str]] | None = None,
    num_documents: int = 24,
    docs_per_shard: int = 8,
    seed: int = 0,
    loss_dtype: str = "float32",
    teacher: dict | None = None,
    space_logprob: bool = False,
    topk: int = 0,
    topk_encoding: str = "float16",
    topk_mode: str = "top",
    target_spans: Callable[[str], tuple] | None = None,
    corpus: dict | None = None,
) -> CacheManifest:
    """Write shards and manifest.json into `dest`; returns the manifest. `space_logprob`: with
    that column (seeded random log-probabilities, NaN where the loss is); `topk` > 0 adds the
    top-k columns (random distributions, as `--topk-probs topk` would store real ones), stored
    as `topk_encoding` (pipeline.cache.topk_codec) says; `target_spans` gives each document's
    spans from its text (stage 1's --targets), stored in the target_spans column; `corpus` is
    the manifest's corpus record (default: the count of documents)."""
    dest = Path(dest)
    documents = documents if documents is not None else corpus_documents(num_documents)
    tokenizer = load_tokenizer(teacher_tokenizer)
    rng = np.random.default_rng(seed)
    sampled = bool(topk) and topk_mode == "sampled"
    space = {"mode": "space+tab+newline+special", "fixture": True} if space_logprob else None
    settings = CacheSettings(
        loss_dtype=loss_dtype,
        topk_probs=topk,
        topk_id_dtype=topk_id_dtype(tokenizer.vocab_size) if topk else None,
        topk_encoding=topk_encoding if topk and not sampled else "float16",
        topk_mode="sampled" if sampled else "top",
        sample_head_size=tokenizer.vocab_size if sampled else None,
        target_spans=target_spans is not None,
        space_logprob=space,
    )
    shards = []
    for index, first in enumerate(range(0, len(documents), docs_per_shard)):
        part = documents[first : first + docs_per_shard]
        encodings = tokenizer.encode_batch([text for _, text in part])
        losses = [teacher_losses(len(enc), rng) for enc in encodings]
        extras = None
        if space_logprob:
            space = [np.log(rng.uniform(0.01, 1.0, len(loss))) for loss in losses]
            extras = {
                SPACE_LOGPROB: [
                    np.where(np.isnan(loss), np.nan, s)
                    for loss, s in zip(losses, space, strict=True)
                ]
            }
        if topk:
            draw = teacher_draws if topk_mode == "sampled" else teacher_topk
            per_document = [draw(len(e), topk, tokenizer.vocab_size, rng) for e in encodings]
            extras = (extras or {}) | {
                name: [d[name] for d in per_document] for name in per_document[0]
            }
        table = build_unit_table(
            [doc_id for doc_id, _ in part],
            [text for _, text in part],
            [sha256_text(text) for _, text in part],
            encodings,
            losses,
            loss_dtype,
            extras,
            settings,
            None if target_spans is None else [target_spans(text) for _, text in part],
        )
        name = shard_name(index)
        size, digest = write_shard(dest / name, table, {"shard": index, "fixture": True})
        shards.append(
            ShardRecord(
                index=index,
                file=name,
                rows=len(part),
                teacher_tokens=sum(len(enc) for enc in encodings),
                bytes=size,
                sha256=digest,
            )
        )
    manifest = CacheManifest(
        teacher=teacher or {"id": "random-losses (tests/cache_fixtures.py)", "seed": seed},
        tokenizer={  # as stage 1 records its teacher's own tokenizer (stage1_score.job)
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "add_bos": tokenizer.policy.add_bos,
            "bos_token": tokenizer.policy.bos_token,
            "source": "teacher",
        },
        settings=settings,
        corpus=corpus or {"documents": len(documents)},
        shards=shards,
    )
    write_manifest(dest, manifest)
    return manifest


def read_cache_rows(cache_dir: Path) -> dict[str, dict]:
    """doc_id -> the row's Python values, read back with plain pyarrow (test oracle)."""
    import pyarrow.parquet as pq

    rows = {}
    for path in sorted(Path(cache_dir).glob("shard-*.parquet")):
        for row in pq.read_table(path).to_pylist():
            rows[row[DOC_ID]] = row
    return rows
