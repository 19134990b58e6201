"""Bytes per top-k entry of each top-k encoding, and what the compact one costs in what stage 2
reads, measured side by side on the same real teacher rows (docs/cache-columns.md).

Usage: python benchmarks/bench_topk_encoding.py --cache DIR [--cache DIR2 ...]
Each DIR is a stage-1 cache made with `--topk-probs 128 --topk-encoding float16` (real teacher
distributions, e.g. SmolLM2-135M-Instruct on the shipped corpus and on CHAMP). For K = 8, 32 and
128 (the first K of the stored 128, the rest recomputed) each shard is written again by the
product's writer (pipeline.cache.writer) in each encoding, and the benchmark prints:
  - bytes per entry: the top-k columns' compressed bytes (probabilities, ids, rest) per teacher
    token, divided by K (goal for the compact encoding: <= 2.0);
  - the largest relative and absolute error of a probability read back, against float16's;
  - the ULD and KLD terms (pipeline.distillation: uld_distance, topk_kl, the functions stage 2
    calls) of a fixed student against each encoding's columns, as a relative difference from
    float16's (goal: within 0.5%). The student is the teacher's float16 distribution tempered
    (p^0.7 over the K ids, 5% of its mass outside them): a student near the teacher, where an
    error in the teacher's probabilities weighs most.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cache.manifest import load_manifest  # noqa: E402
from pipeline.cache.rows import token_values  # noqa: E402
from pipeline.cache.schema import (  # noqa: E402
    LOSS,
    TEXT,
    TEXT_SHA256,
    TOKEN_END,
    TOKEN_IDS,
    TOKEN_START,
    TOPK_CODES,
    TOPK_ID_RANKS,
    TOPK_IDS,
    TOPK_PROBS,
    TOPK_REST,
    iter_shard_batches,
    write_shard,
)
from pipeline.cache.settings import CacheSettings  # noqa: E402
from pipeline.cache.stats import column_bytes  # noqa: E402
from pipeline.cache.writer import build_unit_table  # noqa: E402
from pipeline.distillation.kld import topk_kl  # noqa: E402
from pipeline.distillation.uld import uld_distance  # noqa: E402
from pipeline.tokenizer import Encoding  # noqa: E402

ENCODINGS = ("float16", "compact")
TOPK_COLUMNS = (TOPK_PROBS, TOPK_IDS, TOPK_CODES, TOPK_ID_RANKS, TOPK_REST)
STUDENT_POWER, STUDENT_REST = 0.7, 0.05


def shard_rows(path: Path) -> dict:
    """One shard's rows as the writer takes them, top-k columns per document (float32 / int64)."""
    columns = [TEXT, TEXT_SHA256, "doc_id", TOKEN_IDS, TOKEN_START, TOKEN_END, LOSS]
    batch = next(iter_shard_batches(path, [*columns, TOPK_PROBS, TOPK_IDS, TOPK_REST], 1 << 30))
    lengths = batch.column(TOKEN_IDS).value_lengths().to_numpy()
    cuts = np.cumsum(lengths)[:-1]

    def split(name, dtype):
        return np.split(token_values(batch, name).astype(dtype), cuts)

    return {
        "doc_ids": batch.column("doc_id").to_pylist(),
        "texts": batch.column(TEXT).to_pylist(),
        "hashes": batch.column(TEXT_SHA256).to_pylist(),
        "encodings": [
            Encoding(np.asarray(i), np.asarray(s), np.asarray(e))
            for i, s, e in zip(*(split(n, np.int32) for n in (TOKEN_IDS, TOKEN_START, TOKEN_END)), strict=True)
        ],  # fmt: skip
        "losses": split(LOSS, np.float32),
        TOPK_PROBS: split(TOPK_PROBS, np.float32),
        TOPK_IDS: split(TOPK_IDS, np.int64),
    }


def written(rows: dict, k: int, encoding: str, settings: CacheSettings, folder: Path):
    """(top-k bytes, the probabilities, ids and rest read back) of the rows written at K = k."""
    probs = [p[:, :k] for p in rows[TOPK_PROBS]]
    rest = [np.clip(1 - p.sum(1), 0, None) for p in probs]
    extras = {TOPK_PROBS: probs, TOPK_IDS: [i[:, :k] for i in rows[TOPK_IDS]], TOPK_REST: rest}
    ours = CacheSettings(topk_probs=k, topk_ids=settings.topk_ids,
                         topk_id_dtype=settings.topk_id_dtype, topk_encoding=encoding)  # fmt: skip
    table = build_unit_table(
        rows["doc_ids"], rows["texts"], rows["hashes"], rows["encodings"], rows["losses"],
        "float16", extras, ours,
    )  # fmt: skip
    path = folder / f"{encoding}-{k}.parquet"
    write_shard(path, table, {"benchmark": True})
    sizes = column_bytes(path)
    batch = next(iter_shard_batches(path, [TOPK_PROBS, TOPK_IDS, TOPK_REST], 1 << 30))
    read = {name: token_values(batch, name) for name in (TOPK_PROBS, TOPK_IDS, TOPK_REST)}
    return sum(sizes[name] for name in TOPK_COLUMNS), read


def terms(read: dict, student: dict) -> tuple[float, float]:
    """Mean ULD and KLD terms over the scored positions of the fixed student against `read`."""
    scored = ~np.isnan(read[TOPK_PROBS][:, 0])
    probs = torch.from_numpy(read[TOPK_PROBS][scored].astype(np.float32))
    rest = torch.from_numpy(read[TOPK_REST][scored].astype(np.float32))
    uld = uld_distance(student["top"], student["log_z"], probs, rest)
    valid = torch.ones_like(probs, dtype=torch.bool)
    kld = topk_kl(student["at_ids"], student["log_z"], valid, probs, rest)
    return float(uld.mean()), float(kld.mean())


def fixed_student(reference: dict) -> dict:
    """The student's logits at the teacher's ids, its sorted top and its log normalizer."""
    scored = ~np.isnan(reference[TOPK_PROBS][:, 0])
    probs = torch.from_numpy(reference[TOPK_PROBS][scored].astype(np.float64))
    at_ids = STUDENT_POWER * probs.clamp(min=1e-30).log()
    log_mass = torch.logsumexp(at_ids, -1)
    log_z = log_mass - np.log(1 - STUDENT_REST)  # so that 5% of its mass lies outside the K ids
    return {
        "at_ids": at_ids.float(),
        "top": at_ids.sort(-1, descending=True).values.float(),
        "log_z": log_z.float(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, action="append", required=True)
    args = parser.parse_args(argv)
    print(
        "cache | K | encoding | bytes/entry | largest relative error | largest absolute error | "
        "ULD vs float16 | KLD vs float16"
    )
    for cache in args.cache:
        manifest = load_manifest(cache)
        settings = manifest.settings
        if settings.topk_probs < 128 or settings.topk_encoding != "float16":
            raise SystemExit(f"{cache}: made with --topk-probs 128 --topk-encoding float16, please")
        rows = [shard_rows(cache / record.file) for record in manifest.shards]
        for k in (8, 32, 128):
            with tempfile.TemporaryDirectory() as tmp:
                results = {}
                for encoding in ENCODINGS:
                    total, reads = 0, []
                    for index, shard in enumerate(rows):
                        folder = Path(tmp) / str(index)
                        folder.mkdir(exist_ok=True)
                        size, read = written(shard, k, encoding, settings, folder)
                        total += size
                        reads.append(read)
                    read = {n: np.concatenate([r[n] for r in reads]) for n in reads[0]}
                    results[encoding] = (total, read)
            tokens = len(results["float16"][1][TOPK_PROBS])
            reference = results["float16"][1]
            student = fixed_student(reference)
            base = terms(reference, student)
            for encoding, (total, read) in results.items():
                scored = ~np.isnan(reference[TOPK_PROBS][:, 0])
                ours = read[TOPK_PROBS][scored].astype(np.float64)
                theirs = reference[TOPK_PROBS][scored].astype(np.float64)
                positive = theirs > 0
                relative = np.abs(ours[positive] / theirs[positive] - 1).max()
                absolute = np.abs(ours - theirs).max()
                assert (read[TOPK_IDS] == reference[TOPK_IDS]).all(), "ids must read back exactly"
                uld, kld = terms(read, student)
                print(
                    f"{cache.name} | {k} | {encoding} | {total / tokens / k:.3f} | "
                    f"{relative:.4f} | {absolute:.4f} | {uld / base[0] - 1:+.4%} | "
                    f"{kld / base[1] - 1:+.4%}"
                )
        print(
            f"{cache.name}: {tokens:,} teacher tokens; float16 terms ULD {base[0]:.4f}, "
            f"KLD {base[1]:.4f} (K = 128)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
